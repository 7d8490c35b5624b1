"""The lines of a node's ``GET /v1/kv_events`` feed, checked at the border.

A snapshot first (the feed's version, everything the node's prefix cache can hit, how it
hashes, and the LoRA adapters it serves), then updates (hashes stored and removed, in the
node's order; the adapters again when they changed), each with the node's load. A line that
does not parse as one of these, or a snapshot of another version, is refused with the reason;
the subscriber then reconnects.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from pagedllm.core.kv_events import FEED_VERSION

# block_hash's 16-byte blake2b digests, in lowercase hex.
HashHex = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
MAX_BLOCK_SIZE = 1 << 16


class _Line(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Load(_Line):
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    kv_usage: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)


class Adapter(_Line):
    """A LoRA adapter the node serves: requests name it as their model; ``path`` is part of
    its prefix-cache root (``LoRARequest.key``); ``loaded``: held by its workers now."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    loaded: bool

    @property
    def key(self) -> tuple[str, str]:
        return self.name, self.path


class Snapshot(_Line):
    type: Literal["snapshot"]
    version: int
    seq: int = Field(ge=0)
    block_size: int = Field(ge=1, le=MAX_BLOCK_SIZE)
    hash_seed: int
    num_blocks: int = Field(ge=0)
    blocks: list[tuple[HashHex, HashHex]]
    load: Load
    adapters: list[Adapter]

    @field_validator("version")
    @classmethod
    def _speaks_ours(cls, version: int) -> int:
        if version != FEED_VERSION:
            raise ValueError(f"feed version {version}, this router follows {FEED_VERSION}")
        return version


class Update(_Line):
    type: Literal["update"]
    seq: int = Field(ge=0)
    stored: list[tuple[HashHex, HashHex]]
    removed: list[HashHex]
    load: Load
    # Only when they changed: the node's adapters, all of them.
    adapters: list[Adapter] | None = None


FeedLine = Annotated[Snapshot | Update, Field(discriminator="type")]
_LINE = TypeAdapter(FeedLine)


class FeedError(ValueError):
    """A feed line that is not one of the contract's."""


def parse_line(line: str | bytes) -> Snapshot | Update:
    try:
        return _LINE.validate_json(line)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise FeedError(f"not a kv_events line ({where}: {first.get('msg')})") from None


def hashes(pairs: list[tuple[str, str]]) -> list[bytes]:
    """The block hashes of ``[[hash, parent], ...]``, as bytes."""
    return [bytes.fromhex(h) for h, _ in pairs]
