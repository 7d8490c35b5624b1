"""The GGUF container: metadata and tensor table, read from a memory map.

The ``gguf`` package's ``GGUFReader`` builds a numpy view per item of every metadata array,
which takes seconds for a 100k-entry vocabulary, in each process that opens the file. This reads
the same layout (GGUF v2/v3, little-endian) in a single pass with ``struct``, and hands each
tensor's bytes to ``gguf.quants`` for de-quantization. Types and sizes come from the ``gguf``
package's constants.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {kind: np.dtype(fmt) for kind, fmt in _SCALARS.items()}


class GGUFFormatError(ValueError):
    """Bytes that are not a GGUF file we can read; the message says where and why."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (torch) order: ggml's dimensions reversed
    type: GGMLQuantizationType
    data: np.ndarray  # uint8, shape[:-1] + (bytes per row,), a view of the memory map


@dataclass
class GGUFContents:
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise GGUFFormatError(
                f"a string of {length} bytes at offset {self.pos} runs past the end"
            )
        raw = self.buffer[self.pos : end]
        self.pos = end
        return raw.decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind in _SCALARS:
            return self.unpack(_SCALARS[GGUFValueType(kind)])
        if kind != GGUFValueType.ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind} at offset {self.pos}")
        item_kind, count = self.unpack("<I"), self.unpack("<Q")
        if item_kind in _NUMPY:
            dtype = _NUMPY[GGUFValueType(item_kind)]
            end = self.pos + count * dtype.itemsize
            if end > len(self.buffer):
                raise GGUFFormatError(f"an array of {count} items runs past the end")
            values = np.frombuffer(self.buffer, dtype, count, self.pos).tolist()
            self.pos = end
            return values
        return [self.value(item_kind) for _ in range(count)]


def read_gguf(path: Path) -> GGUFContents:
    """Metadata and tensor table of the GGUF file at ``path`` (its tensors stay mapped)."""
    with path.open("rb") as handle:
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer)
    try:
        return _read(cursor)
    except struct.error as error:
        raise GGUFFormatError(f"truncated at offset {cursor.pos}: {error}") from None
    except UnicodeDecodeError as error:
        raise GGUFFormatError(
            f"a string before offset {cursor.pos} is not UTF-8: {error}"
        ) from None


def _read(cursor: _Cursor) -> GGUFContents:
    magic = cursor.buffer[:4]
    if magic != MAGIC:
        raise GGUFFormatError(f"not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFFormatError(
            f"GGUF version {version} (or a big-endian file) is not supported; "
            f"supported: {', '.join(map(str, SUPPORTED_VERSIONS))}"
        )
    num_tensors, num_values = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_values):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    headers = [_tensor_header(cursor) for _ in range(num_tensors)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1:
        raise GGUFFormatError(f"general.alignment must be a positive integer, got {alignment!r}")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in headers:
        tensors[name] = _tensor(cursor.buffer, name, dims, kind, data_start + offset)
    return GGUFContents(metadata, tensors)


def _tensor_header(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    num_dims = cursor.unpack("<I")
    if num_dims > 8:
        raise GGUFFormatError(f"tensor {name} claims {num_dims} dimensions")
    dims = tuple(cursor.unpack("<Q") for _ in range(num_dims))
    return name, dims, cursor.unpack("<I"), cursor.unpack("<Q")


def _tensor(
    buffer: mmap.mmap, name: str, dims: tuple[int, ...], kind: int, start: int
) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise GGUFFormatError(f"tensor {name} has unknown ggml type {kind}") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row = dims[0] if dims else 1
    if row % block_size:
        raise GGUFFormatError(
            f"tensor {name}: rows of {row} values are not whole {qtype.name} blocks"
        )
    shape = tuple(reversed(dims)) or (1,)
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    row_bytes = row // block_size * type_size
    if start + rows * row_bytes > len(buffer):
        raise GGUFFormatError(f"tensor {name} runs past the end of the file")
    data = np.frombuffer(buffer, np.uint8, rows * row_bytes, start)
    return TensorInfo(name, shape, qtype, data.reshape(*shape[:-1], row_bytes))
