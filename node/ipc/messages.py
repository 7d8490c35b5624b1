"""The messages the node's processes exchange over ZeroMQ, and their msgpack envelope.

Every message is ``[tag, version, payload]``: the tag names one of the classes below, the
version is that class's schema version (bumped whenever its fields change), and the payload is
the class's wire form (see ``wire_codec``). A message with an unknown tag, another version or a
payload that does not fit raises ``WireError``; receivers log and drop it.

Who sends what:
- API server -> scheduler: AddRequest, AbortRequest, StopSequence, WatchKVMap (while a page
  shows the block map, at least every ``WATCH_LEASE_S / 3``), LoadLoRAAdapter and
  UnloadLoRAAdapter
- scheduler -> API server: RequestOutputs, RequestRejected, LoRAAdapterUpdated; to every API
  server LoRAAdapters when the adapters change; KVMap while it watches (at most
  one per ``KV_MAP_INTERVAL_S``, see ``serve.kv_map_sender``); to every API server:
  CacheLayout once, then KVEvents each step the prefix cache, the load or the adapters
  (those served, and which are loaded) changed, and at least once a second when idle (the
  KV-events feed, see ``api.kv_events``)
- scheduler -> workers: StepPlan; worker rank 0 -> scheduler: WorkerReady, StepResult,
  StepRefused
- every process -> supervisor: ProcessReady; API server -> supervisor: ApiServerIdle;
  scheduler -> supervisor: NodeFailed (the node cannot make progress)
- supervisor -> API servers: NodeReady, Drain, DrainDeadline, NodeFailed
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from pagedllm.core.kv_events import AdapterState, KVUpdate, NodeLoad
from pagedllm.core.kv_map import KVMap
from pagedllm.core.lora_request import LoRARequest
from pagedllm.core.request_delta import RequestDelta
from pagedllm.core.step_plan import StepPlan, StepResult
from pagedllm.ipc.codec import WireError, decoder, encoder
from pagedllm.ipc.step_codec import decode_plan, decode_result, encode_plan, encode_result
from pagedllm.sampling_params import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    # Which API server gets the outputs.
    client_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic(), which all processes of a machine share
    # Only the first token and the end are wanted; the steps between arrive merged with the end.
    final_only: bool = False
    # False for the second and later prompts of one HTTP request: they join the first, which
    # alone is held to --max-waiting, so that a request is never half refused as busy.
    first_of_request: bool = True
    # The LoRA adapter the request's model names (None: the base model).
    lora: LoRARequest | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class StopSequence:
    """A stop string ended sequence ``index`` of a request (found while detokenizing)."""

    request_id: str
    index: int
    stop: str


@dataclass
class WatchKVMap:
    """API server ``client_index`` shows the block map: send it KVMaps until
    ``WATCH_LEASE_S`` pass without another WatchKVMap."""

    client_index: int


# How long one WatchKVMap keeps the maps coming, and the least time between two maps.
WATCH_LEASE_S = 3.0
KV_MAP_INTERVAL_S = 0.25


@dataclass
class RequestOutputs:
    deltas: list[RequestDelta]


@dataclass
class LoadLoRAAdapter:
    """Add an adapter requests may name (``POST /v1/load_lora_adapter``)."""

    request_id: str
    client_index: int
    lora_name: str
    lora_path: str


@dataclass
class UnloadLoRAAdapter:
    """Remove an adapter from those requests may name; requests already queued keep it."""

    request_id: str
    client_index: int
    lora_name: str


@dataclass
class LoRAAdapterUpdated:
    """The answer to a (Un)LoadLoRAAdapter: an HTTP status and its message."""

    request_id: str
    status: int
    message: str


@dataclass
class LoRAAdapters:
    """The adapters requests may name now (name -> directory), to every API server."""

    adapters: dict[str, str]


@dataclass
class RequestRejected:
    """The scheduler refused a request before queueing it; ``status`` is the HTTP status."""

    request_id: str
    status: int
    message: str


@dataclass
class CacheLayout:
    """How the scheduler hashes KV blocks: what a subscriber needs to hash prompts alike."""

    block_size: int
    hash_seed: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise ValueError(f"block_size {self.block_size}, num_blocks {self.num_blocks}")


@dataclass
class KVEvents:
    """The prefix cache's changes since the last KVEvents, in order (none: a heartbeat), and
    the load after them; the node's LoRA adapters when they changed (None: as before)."""

    updates: list[KVUpdate]
    load: NodeLoad
    adapters: list[AdapterState] | None = None


@dataclass
class WorkerReady:
    rank: int
    num_blocks: int
    max_model_len: int
    # Rows of the model's embedding: every token id the workers are sent must be below it.
    vocab_size: int


@dataclass
class StepRefused:
    """A worker found a step plan impossible to execute and left its state untouched."""

    step_id: int
    reason: str


@dataclass
class ProcessReady:
    kind: str
    index: int


@dataclass
class ApiServerIdle:
    """A draining API server has no request in flight any more."""

    index: int


@dataclass
class NodeReady:
    pass


@dataclass
class Drain:
    pass


@dataclass
class DrainDeadline:
    """The drain's --shutdown-timeout has passed: whatever is still in flight ends now."""

    timeout_s: float


@dataclass
class NodeFailed:
    reason: str


Message = (
    AddRequest
    | AbortRequest
    | StopSequence
    | WatchKVMap
    | LoadLoRAAdapter
    | UnloadLoRAAdapter
    | RequestOutputs
    | RequestRejected
    | LoRAAdapterUpdated
    | LoRAAdapters
    | CacheLayout
    | KVEvents
    | KVMap
    | WorkerReady
    | StepRefused
    | ProcessReady
    | ApiServerIdle
    | NodeReady
    | Drain
    | DrainDeadline
    | NodeFailed
    | StepPlan
    | StepResult
)


@dataclass(frozen=True)
class Schema:
    tag: str
    cls: type
    version: int
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


def _typed(tag: str, cls: type, version: int) -> Schema:
    return Schema(tag, cls, version, encoder(cls), decoder(cls))


SCHEMAS: dict[str, Schema] = {
    s.tag: s
    for s in (
        _typed("add_request", AddRequest, 6),
        _typed("load_lora_adapter", LoadLoRAAdapter, 1),
        _typed("unload_lora_adapter", UnloadLoRAAdapter, 1),
        _typed("lora_adapter_updated", LoRAAdapterUpdated, 1),
        _typed("lora_adapters", LoRAAdapters, 1),
        _typed("abort_request", AbortRequest, 1),
        _typed("stop_sequence", StopSequence, 1),
        _typed("request_outputs", RequestOutputs, 3),
        _typed("request_rejected", RequestRejected, 1),
        _typed("cache_layout", CacheLayout, 1),
        _typed("kv_events", KVEvents, 2),
        _typed("watch_kv_map", WatchKVMap, 1),
        _typed("kv_map", KVMap, 1),
        _typed("worker_ready", WorkerReady, 2),
        _typed("step_refused", StepRefused, 1),
        _typed("process_ready", ProcessReady, 1),
        _typed("api_server_idle", ApiServerIdle, 1),
        _typed("node_ready", NodeReady, 1),
        _typed("drain", Drain, 1),
        _typed("drain_deadline", DrainDeadline, 1),
        _typed("node_failed", NodeFailed, 1),
        # The per-step pair travels column-wise (see step_wire).
        Schema("step_plan", StepPlan, 5, encode_plan, decode_plan),
        Schema("step_result", StepResult, 1, encode_result, decode_result),
    )
}
_BY_CLASS = {s.cls: s for s in SCHEMAS.values()}


def encode(message: Message) -> bytes:
    schema = _BY_CLASS[type(message)]
    return msgpack.packb([schema.tag, schema.version, schema.encode(message)], use_bin_type=True)


def decode(data: bytes) -> Message:
    """The message in ``data``; ``WireError`` when it is not one of ours."""
    try:
        envelope: Any = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as error:  # msgpack raises several unrelated types on bad input
        raise WireError(f"not msgpack: {error}") from None
    if not (isinstance(envelope, list) and len(envelope) == 3 and isinstance(envelope[0], str)):
        raise WireError("expected [tag, version, payload]")
    tag, version, payload = envelope
    schema = SCHEMAS.get(tag)
    if schema is None:
        raise WireError(f"unknown message type {tag!r}")
    if version != schema.version:
        raise WireError(f"{tag} schema version {version!r}, this node speaks {schema.version}")
    return schema.decode(payload)
