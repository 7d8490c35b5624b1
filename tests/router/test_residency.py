"""The residency index the router keeps from a node's feed equals the node's real prefix
cache, whatever the node stored and evicted and however often the feed reconnected.

A real block manager (the node's own) serves random requests on a small cache so that blocks
are shared, freed and evicted; after each step, the contract's lines (a snapshot on each
reconnect, updates with what entered and left the hash map) go through the router's parser and
feed logic. The router's index must then hold exactly the node's hashes, and predict exactly
the prefix the node would hit for any prompt.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_manager import BlockManager, root_hash
from pagedllm.core.kv_events import FEED_VERSION
from pagedllm.core.request_delta import RequestTimings
from pagedllm.core.sequence import Request, Sequence
from pagedllm.router.feed import apply_line, lines_of
from pagedllm.router.feed_messages import FeedError, parse_line
from pagedllm.router.fleet import Backend
from pagedllm.router.hashing import HashScheme, block_hashes
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24
SEED = 3
LOAD = {"running": 1, "waiting": 0, "kv_usage": 0.5}


class Node:
    """A block manager and the feed it would publish."""

    def __init__(self) -> None:
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, seed=SEED)
        self.running: list[Sequence] = []
        self.parents: dict[bytes, bytes] = {}
        self.published: set[bytes] = set()
        self.seq = 0
        self.next_id = 0

    def truth(self) -> set[bytes]:
        return set(self.bm.pool._by_hash)

    def admit(self, prompt: list[int]) -> None:
        request = Request(str(self.next_id), prompt, SamplingParams(), (), RequestTimings(0.0))
        seq = Sequence(self.next_id, request, list(prompt))
        self.next_id += 1
        hit = self.bm.find_prefix(seq)
        if not self.bm.allocate(seq, len(prompt), hit):
            return
        seq.num_computed_tokens = seq.num_kv_tokens = len(prompt)
        self.bm.register_computed(seq)
        parent = root_hash(SEED)
        for h in seq.blocks.hashes:
            self.parents[h] = parent
            parent = h
        self.running.append(seq)

    def finish(self, index: int) -> None:
        if self.running:
            self.bm.free(self.running.pop(index % len(self.running)))

    def pair(self, h: bytes) -> list[str]:
        return [h.hex(), self.parents[h].hex()]

    def snapshot_line(self) -> str:
        self.published = self.truth()
        self.seq = 0
        blocks = [self.pair(h) for h in self.published]
        return json.dumps(
            {
                "type": "snapshot",
                "version": FEED_VERSION,
                "seq": 0,
                "block_size": BLOCK_SIZE,
                "hash_seed": SEED,
                "num_blocks": NUM_BLOCKS,
                "blocks": blocks,
                "load": {**LOAD, "running": len(self.running)},
                "adapters": [],
            }
        )

    def update_line(self) -> str:
        now = self.truth()
        stored, removed = now - self.published, self.published - now
        self.published = now
        self.seq += 1
        return json.dumps(
            {
                "type": "update",
                "seq": self.seq,
                "stored": [self.pair(h) for h in stored],
                "removed": [h.hex() for h in removed],
                "load": {**LOAD, "running": len(self.running)},
                "adapters": [],
            }
        )


# Prompts over a few shared prefixes, so that requests hit, share and evict each other's blocks.
PREFIXES = [[5 + p] * 8 + list(range(10 * p, 10 * p + 4)) for p in range(4)]
prompt_strategy = st.builds(
    lambda p, tail: PREFIXES[p] + tail,
    st.integers(0, len(PREFIXES) - 1),
    st.lists(st.integers(5, 40), min_size=0, max_size=9),
)
step_strategy = st.one_of(
    st.tuples(st.just("admit"), prompt_strategy),
    st.tuples(st.just("finish"), st.integers(0, 10)),
    st.tuples(st.just("reconnect"), st.none()),
)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(step_strategy, min_size=1, max_size=60),
    probes=st.lists(prompt_strategy, max_size=5),
)
def test_the_index_follows_the_node_through_stores_evictions_and_reconnects(steps, probes) -> None:
    node = Node()
    backend = Backend("http://node")
    expected = apply_line(backend, parse_line(node.snapshot_line()), None)
    for kind, arg in steps:
        if kind == "admit":
            node.admit(arg)
        elif kind == "finish":
            node.finish(arg)
        if kind == "reconnect":
            backend.residency = None  # what the follower does when a feed breaks
            expected = apply_line(backend, parse_line(node.snapshot_line()), None)
        else:
            expected = apply_line(backend, parse_line(node.update_line()), expected)
        assert backend.residency is not None
        assert backend.residency.hashes == node.truth()
        assert (
            backend.feed_load is not None
            and backend.feed_load.running == len(node.running)
            or kind == "reconnect"
        )
    scheme = HashScheme(BLOCK_SIZE, SEED)
    for prompt in probes + PREFIXES:
        request = Request("p", prompt, SamplingParams(), (), RequestTimings(0.0))
        hit = node.bm.find_prefix(Sequence(999, request, list(prompt)))
        assert backend.residency.cached_tokens(block_hashes(prompt, scheme)) == hit.num_tokens


def test_a_lost_line_is_an_error_until_the_next_snapshot() -> None:
    node = Node()
    backend = Backend("http://node")
    expected = apply_line(backend, parse_line(node.snapshot_line()), None)
    node.admit(PREFIXES[0])
    node.update_line()  # never delivered
    node.admit(PREFIXES[1])
    with pytest.raises(FeedError, match="out of order"):
        apply_line(backend, parse_line(node.update_line()), expected)
    backend.residency = None
    with pytest.raises(FeedError):  # no update without a snapshot first
        apply_line(backend, parse_line(node.update_line()), None)
    apply_line(backend, parse_line(node.snapshot_line()), None)
    assert backend.residency is not None and backend.residency.hashes == node.truth()


ZERO = {"running": 0, "waiting": 0, "kv_usage": 0}
UPDATE = {"type": "update", "seq": 1, "stored": [], "removed": [], "load": ZERO}
SNAPSHOT = {
    "type": "snapshot",
    "version": FEED_VERSION,
    "seq": 0,
    "block_size": 16,
    "hash_seed": 0,
    "num_blocks": 1,
    "blocks": [],
    "load": ZERO,
    "adapters": [],
}
ADAPTER = {"name": "sql", "path": "/adapters/sql", "loaded": True}


@pytest.mark.parametrize(
    "line, reason",
    [
        ("not json", "kv_events"),
        (json.dumps({**UPDATE, "removed": ["XYZ"]}), "removed"),
        (json.dumps({**UPDATE, "stored": [["ab" * 16]]}), "stored"),
        (json.dumps({**SNAPSHOT, "block_size": 0}), "block_size"),
        (json.dumps({**UPDATE, "load": {**ZERO, "running": -1}}), "running"),
        (json.dumps({**UPDATE, "load": {**ZERO, "kv_usage": 2}}), "kv_usage"),
        ('{"type": "gossip"}', "type"),
        (json.dumps({**SNAPSHOT, "version": 1}), "feed version 1"),
        (json.dumps({k: v for k, v in SNAPSHOT.items() if k != "adapters"}), "adapters"),
        (json.dumps({**SNAPSHOT, "adapters": [{**ADAPTER, "name": ""}]}), "name"),
        (json.dumps({**UPDATE, "adapters": [{**ADAPTER, "loaded": "maybe"}]}), "loaded"),
        (json.dumps({**UPDATE, "adapters": [{"name": "sql", "loaded": True}]}), "path"),
        ("[1, 2]", "kv_events"),
    ],
)
def test_malformed_lines_are_refused_with_the_reason(line: str, reason: str) -> None:
    with pytest.raises(FeedError, match=reason):
        parse_line(line)


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"")), max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
    ends_open=st.booleans(),
)
def test_feed_lines_survive_any_chunking(
    lines: list[bytes], cuts: list[int], ends_open: bool
) -> None:
    """However the stream is cut into chunks, the lines come out whole and in order, a last
    line without its newline included."""
    stream = b"".join(line + b"\n" for line in lines)
    if ends_open and lines:
        stream = stream[:-1]
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    chunks = [stream[a:b] for a, b in zip(points, points[1:], strict=False)]

    async def gather() -> list[bytes]:
        async def source() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        return [line async for line in lines_of(source())]

    expected = lines[:-1] + ([lines[-1]] if lines[-1] or not ends_open else []) if lines else []
    assert asyncio.run(gather()) == expected


def test_a_snapshot_line_larger_than_aiohttp_reads_is_whole() -> None:
    line = b"x" * (3 << 20)

    async def gather() -> list[bytes]:
        async def source() -> AsyncIterator[bytes]:
            data = line + b"\nnext\n"
            for start in range(0, len(data), 65536):
                yield data[start : start + 65536]

        return [line async for line in lines_of(source())]

    assert asyncio.run(gather()) == [line, b"next"]
