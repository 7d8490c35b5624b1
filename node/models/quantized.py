"""Weights kept quantized in memory: GGUF's block formats repacked once at load into the group
layouts of :mod:`pagedllm.kernels.quant_linear`, and float weights quantized to int8 groups.

Every GGUF type kept here maps onto ``W = scale * q + min`` per group of 16 or 32 input
features without loss: Q4_0, Q4_1 and Q4_K keep 4-bit values (Q4_0's and Q4_1's blocks byte for
byte), Q8_0, Q5_0, Q5_1, Q5_K and Q6_K keep theirs in a byte each. The K-quants' two-level
scales are multiplied out into float16 (the one rounding: a product of a float16 and a 6- or
8-bit integer in float16). Other types (Q2_K, Q3_K) are de-quantized by the caller.

``--quantization`` chooses: ``gguf`` keeps a GGUF file's quantized tensors (the default for a
file that has any), ``int8`` quantizes float weights (a Hugging Face checkpoint, or a GGUF file
de-quantized) to int8 in groups of 32, symmetric, ``none`` de-quantizes into ``--dtype``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.kernels.quant_linear import NIBBLE_GROUP, dequantize
from pagedllm.models import ModelLoadError

INT8_GROUP = 32
QK_K = 256  # the super-block of the K-quants
# GGUF types this module keeps quantized.
KEPT_GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight in the layout of ``quant_linear``."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.qweight.shape
        return rows, width * 2 if self.bits == 4 else width

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.scales, self.mins) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(
            self.qweight, self.scales, self.mins, self.bits, self.group_size, dtype=dtype
        )

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The output features ``index`` (a slice or a permutation)."""
        return dataclasses.replace(
            self,
            qweight=self.qweight[index].contiguous(),
            scales=self.scales[index].contiguous(),
            mins=None if self.mins is None else self.mins[index].contiguous(),
        )

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Input features ``start:stop``, which must fall on group boundaries."""
        group = NIBBLE_GROUP if self.bits == 4 else self.group_size
        if start % group or stop % group:
            raise ModelLoadError(
                f"cannot split a weight quantized in groups of {group} at input features "
                f"{start}:{stop}; the tensor-parallel shard must be a whole number of groups"
            )
        per_byte = 2 if self.bits == 4 else 1
        g0, g1 = start // self.group_size, stop // self.group_size
        return dataclasses.replace(
            self,
            qweight=self.qweight[:, start // per_byte : stop // per_byte].contiguous(),
            scales=self.scales[:, g0:g1].contiguous(),
            mins=None if self.mins is None else self.mins[:, g0:g1].contiguous(),
        )

    def widened(self, bits: int, group_size: int, with_mins: bool) -> QuantizedWeight:
        """The same values in a layout at least as wide: 4-bit values in bytes, groups of 32
        as pairs of 16, zero minimums added."""
        weight = self
        if weight.bits == 4 and bits == 8:
            unpacked = torch.cat(
                (
                    weight.qweight.reshape(weight.shape[0], -1, 16) & 15,
                    weight.qweight.reshape(weight.shape[0], -1, 16) >> 4,
                ),
                dim=-1,
            )
            weight = dataclasses.replace(
                weight, qweight=unpacked.reshape(weight.shape[0], -1).to(torch.int8), bits=8
            )
        if weight.group_size != group_size:
            repeat = weight.group_size // group_size
            weight = dataclasses.replace(
                weight,
                scales=weight.scales.repeat_interleave(repeat, dim=1),
                mins=None if weight.mins is None else weight.mins.repeat_interleave(repeat, dim=1),
                group_size=group_size,
            )
        if with_mins and weight.mins is None:
            weight = dataclasses.replace(weight, mins=torch.zeros_like(weight.scales))
        return weight

    def to(self, device: torch.device) -> QuantizedWeight:
        return dataclasses.replace(
            self,
            qweight=self.qweight.to(device),
            scales=self.scales.to(device),
            mins=None if self.mins is None else self.mins.to(device),
        )


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The weights stacked along their output features (q/k/v, gate/up), in the narrowest
    layout that holds them all."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    group = min(p.group_size for p in parts)
    with_mins = any(p.mins is not None for p in parts)
    parts = [p.widened(bits, group, with_mins) for p in parts]
    return QuantizedWeight(
        qweight=torch.cat([p.qweight for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        mins=torch.cat([p.mins for p in parts]) if with_mins else None,  # type: ignore[misc]
        bits=bits,
        group_size=group,
    )


def quantize_int8(weight: torch.Tensor, group_size: int = INT8_GROUP) -> QuantizedWeight:
    """``weight`` in symmetric int8 groups: ``scale = max |w| / 127`` per group, rounded to
    float16 before the values are rounded, so that ``scale * q`` is what the kernel computes."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ModelLoadError(
            f"cannot quantize a weight of {cols} input features in groups of {group_size}"
        )
    groups = weight.detach().float().reshape(rows, -1, group_size)
    scales = (groups.abs().amax(dim=-1) / 127).to(torch.float16)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).float()
    q = torch.round(groups / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(q.reshape(rows, cols), scales, None, bits=8, group_size=group_size)


# GGUF block decoders: each takes the ``[blocks, bytes per block]`` uint8 blocks of a tensor
# and returns ``(values [blocks, block size], scales, mins or None, bits, group size)``, values
# uint8 for 4-bit formats (0..15) and int8 otherwise, scales and mins float32
# ``[blocks, block size / group size]``; ``W = scale * q + min``, as gguf's ``dequantize``.


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16-byte nibble order: 32 values, the low nibbles first."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _decode_q8_0(blocks: np.ndarray) -> tuple:
    return blocks[:, 2:].view(np.int8), _f16(blocks, 0), None, 8, 32


def _decode_q4_0(blocks: np.ndarray) -> tuple:
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:]), d, -8 * d, 4, 32


def _decode_q4_1(blocks: np.ndarray) -> tuple:
    return _nibbles(blocks[:, 4:]), _f16(blocks, 0), _f16(blocks, 2), 4, 32


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit ``i`` of the little-endian 32-bit word is value ``i``'s fifth bit."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _decode_q5_0(blocks: np.ndarray) -> tuple:
    q = _nibbles(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6]) << 4)
    return (q.astype(np.int16) - 16).astype(np.int8), _f16(blocks, 0), None, 8, 32


def _decode_q5_1(blocks: np.ndarray) -> tuple:
    q = _nibbles(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8]) << 4)
    return q.astype(np.int8), _f16(blocks, 0), _f16(blocks, 2), 8, 32


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 6-bit scale and minimum of each of the 8 sub-blocks, times the
    super-block's ``d`` and ``dmin``."""
    packed = blocks[:, 4:16].reshape(-1, 3, 4)
    d, m, m_d = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return _f16(blocks, 0) * sc, -_f16(blocks, 2) * mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 4 runs of 32 bytes, the low nibbles of a run one sub-block of 32 values and
    its high nibbles the next."""
    runs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate((runs & 0x0F, runs >> 4), axis=2).reshape(-1, QK_K)


def _decode_q4_k(blocks: np.ndarray) -> tuple:
    scales, mins = _k_scales(blocks)
    return _k_low_nibbles(blocks[:, 16:]), scales, mins, 4, 32


def _decode_q5_k(blocks: np.ndarray) -> tuple:
    scales, mins = _k_scales(blocks)
    qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _k_low_nibbles(blocks[:, 48:]) | ((qh & 1).reshape(-1, QK_K) << 4)
    return q.astype(np.int8), scales, mins, 8, 32


def _decode_q6_k(blocks: np.ndarray) -> tuple:
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 4, 1
    )
    qh = (qh & 0x03).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).astype(np.int16) - 32).astype(np.int8).reshape(-1, QK_K)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32) * _f16(blocks, 208)
    return q, scales, None, 8, 16


_DECODERS = {
    "Q8_0": (_decode_q8_0, 32, 34),
    "Q4_0": (_decode_q4_0, 32, 18),
    "Q4_1": (_decode_q4_1, 32, 20),
    "Q5_0": (_decode_q5_0, 32, 22),
    "Q5_1": (_decode_q5_1, 32, 24),
    "Q4_K": (_decode_q4_k, QK_K, 144),
    "Q5_K": (_decode_q5_k, QK_K, 176),
    "Q6_K": (_decode_q6_k, QK_K, 210),
}


def from_gguf_blocks(kind: str, data: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """The weight of a ``[rows, cols]`` GGUF tensor of type ``kind`` (one of
    ``KEPT_GGUF_TYPES``) from its raw bytes ``data`` (``[rows, bytes per row]``)."""
    decode, block, block_bytes = _DECODERS[kind]
    if cols % block or data.shape != (rows, cols // block * block_bytes):
        raise ModelLoadError(
            f"a {kind} tensor of shape [{rows}, {cols}] cannot hold {list(data.shape)} bytes"
        )
    blocks = np.ascontiguousarray(data).reshape(-1, block_bytes)
    values, scales, mins, bits, group = decode(blocks)
    values = values.reshape(rows, cols)
    if bits == 4:  # to the layout's nibble order, 32 values in 16 bytes (Q4_0/Q4_1's own)
        halves = values.reshape(rows, -1, 2, 16)
        values = halves[:, :, 0] | (halves[:, :, 1] << 4)
        values = values.reshape(rows, cols // 2)
    return QuantizedWeight(
        qweight=torch.from_numpy(np.ascontiguousarray(values)),
        scales=torch.from_numpy(scales.reshape(rows, -1)).to(torch.float16),
        mins=None if mins is None else torch.from_numpy(mins.reshape(rows, -1)).to(torch.float16),
        bits=bits,
        group_size=group,
    )


def lookup(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the weight, de-quantized (an embedding lookup)."""
    return weight.rows(ids.reshape(-1)).dequantize(dtype).reshape(*ids.shape, -1)


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct tensor storages: parameters, buffers and quantized
    weights, a storage shared by two (a tied head) counted once."""
    storages: dict[int, int] = {}
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        weight = getattr(module, "quantized", None)
        if isinstance(weight, QuantizedWeight):
            tensors.extend(weight.tensors())
        packed = getattr(module, "packed", None)
        if packed is not None:  # an opaque packed layout: no storage to share
            storages[id(packed)] = packed.nbytes
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
