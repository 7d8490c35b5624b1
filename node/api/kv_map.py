"""An API server's side of the block map (``GET /kv``): the viewers, the watch it keeps on the
scheduler while they stay, and each map as one server-sent event.

The scheduler sends maps only while this server renews its watch (``WatchKVMap``), which it does
every ``RENEW_S`` while at least one page is open. Each viewer keeps only the newest map: one
that reads slowly skips maps instead of queueing them.

A map travels to the page as JSON whose block-id columns are base64 of little-endian int32 (a
hundred thousand blocks stay a few hundred kilobytes, and the page reads them into typed arrays
without parsing numbers).
"""

from __future__ import annotations

import array
import asyncio
import base64
import json
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.kv_map import SHOWN_HASH_BYTES, KVMap
from pagedllm.ipc.messages import WATCH_LEASE_S

RENEW_S = WATCH_LEASE_S / 3
# An SSE comment at least this often, so that proxies keep an idle stream open.
KEEPALIVE_S = 15.0


@dataclass(eq=False)
class Viewer:
    # The newest map not yet sent (older ones are replaced); None ends the stream.
    latest: asyncio.Queue[bytes | None] = field(default_factory=lambda: asyncio.Queue(1))

    def offer(self, event: bytes | None) -> None:
        if self.latest.full():
            self.latest.get_nowait()
        self.latest.put_nowait(event)


@dataclass
class KVMapView:
    # Asks the scheduler for maps (sends WatchKVMap).
    watch: Callable[[], None]
    viewers: set[Viewer] = field(default_factory=set)
    last: bytes | None = None
    seq: int = 0
    closed: bool = False

    def apply(self, kv_map: KVMap) -> None:
        """A map from the scheduler: pass it to every viewer."""
        self.seq += 1
        self.last = event(kv_map, self.seq)
        for viewer in self.viewers:
            viewer.offer(self.last)

    def subscribe(self) -> Viewer:
        viewer = Viewer()
        if not self.viewers:
            self.watch()  # the first viewer need not wait for the next renewal
        self.viewers.add(viewer)
        if self.last is not None:
            viewer.offer(self.last)
        return viewer

    def unsubscribe(self, viewer: Viewer) -> None:
        self.viewers.discard(viewer)

    def close(self) -> None:
        """End every stream: the node drains or failed."""
        self.closed = True
        for viewer in self.viewers:
            viewer.offer(None)
        self.viewers.clear()

    async def renew_watch(self) -> None:
        while not self.closed:
            await asyncio.sleep(RENEW_S)
            if self.viewers:
                self.watch()

    @staticmethod
    async def stream(viewer: Viewer) -> AsyncIterator[bytes]:
        while True:
            try:
                data = await asyncio.wait_for(viewer.latest.get(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if data is None:
                return
            yield data


def _ids(values: list[int]) -> str:
    packed = array.array("i", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()


def event(kv_map: KVMap, seq: int) -> bytes:
    """``kv_map`` as one server-sent event named ``map``."""
    totals = kv_map.totals
    value: dict[str, Any] = {
        "seq": seq,
        "num_blocks": kv_map.num_blocks,
        "block_size": kv_map.block_size,
        "num_used": kv_map.num_used,
        "seqs": [
            {
                "request": s.request_id,
                "index": s.index,
                "tokens": s.num_tokens,
                "blocks": _ids(s.block_ids),
            }
            for s in kv_map.seqs
        ],
        "shared": {"ids": _ids(kv_map.shared_ids), "refs": _ids(kv_map.shared_refs)},
        "cached": {
            "ids": _ids(kv_map.cached_ids),
            "hashes": base64.b64encode(kv_map.cached_hashes).decode(),
            "hash_bytes": SHOWN_HASH_BYTES,
            "reuses": _ids(kv_map.cached_reuses),
        },
        "running": totals.running,
        "waiting": totals.waiting,
        "waste_slots": totals.waste_slots,
        "prefix_queries": totals.prefix_queries,
        "prefix_hits": totals.prefix_hits,
    }
    return b"event: map\ndata: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"
