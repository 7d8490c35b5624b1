"""A real node's KV-events feed: exactly the block hashes of the prompts it cached, the same for
early and late subscribers and for every API server, evictions as ``removed``, heartbeats
when idle, the API key, and the end of the feed when the node drains."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from pagedllm.core.block_manager import block_hash, root_hash
from pagedllm_testing.kv_feed_reader import FeedReader
from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server

KEY = "kv-events-key"
BLOCK_SIZE = 16
SHARED = (
    "You are a careful assistant for a shipping company. Answer in one short sentence, name "
    "the port, the vessel and the day, and never promise a delivery date you cannot keep. "
)


def chain(token_ids: list[int], seed: int = 0) -> dict[str, str]:
    """hash -> parent (hex) of every full block of ``token_ids``, as the contract names them."""
    blocks: dict[str, str] = {}
    parent = root_hash(seed)
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        h = block_hash(parent, token_ids[start : start + BLOCK_SIZE])
        blocks[h.hex()] = parent.hex()
        parent = h
    return blocks


def tokenize(server: Server, prompt: str) -> list[int]:
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    answer = httpx.post(
        f"{server.url}/tokenize",
        json={"model": DEMO_MODEL, "prompt": prompt},
        headers=headers,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    tokens: list[int] = answer.json()["tokens"]
    return tokens


def complete(server: Server, prompt: str) -> None:
    """One token only: the prompt's blocks are cached, no block of generated tokens is."""
    server.client().completions.create(model=DEMO_MODEL, prompt=prompt, max_tokens=1)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(
        tmp_path_factory.mktemp("kv-events"), "--api-server-count", "2", api_key=KEY
    )
    yield running
    running.stop()


def test_the_feed_needs_the_api_key(keyed: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        answer = httpx.get(f"{keyed.url}/v1/kv_events", headers=headers, timeout=10)
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "invalid_api_key"
    reader = FeedReader(keyed.url, KEY)
    try:
        reader.wait_for(lambda r: r.snapshot is not None, timeout=30)
        assert reader.status == 200
        assert reader.content_type == "application/x-ndjson"
        snapshot = reader.snapshot
        assert snapshot is not None
        assert (snapshot["block_size"], snapshot["hash_seed"]) == (BLOCK_SIZE, 0)
        assert snapshot["num_blocks"] == 512  # 32 MiB of the demo model's KV cache
        assert set(snapshot["load"]) == {"running", "waiting", "kv_usage"}
    finally:
        reader.close()


def test_subscribers_see_exactly_the_prompts_blocks(keyed: Server) -> None:
    # Several subscriptions, so that both API servers serve some (the kernel spreads them).
    early = [FeedReader(keyed.url, KEY) for _ in range(4)]
    try:
        for reader in early:
            reader.wait_for(lambda r: r.snapshot is not None, timeout=30)
        before = early[0].state()
        prompts = [SHARED * 3 + f"Question {i}: where is parcel {i * 7919}?" for i in range(3)]
        expected = dict(before)
        for prompt in prompts:
            tokens = tokenize(keyed, prompt)
            assert len(tokens) > 6 * BLOCK_SIZE
            expected.update(chain(tokens))
            complete(keyed, prompt)
        shared_blocks = set(chain(tokenize(keyed, SHARED * 3)))
        assert shared_blocks and shared_blocks <= set(expected)
        for reader in early:
            reader.wait_for(lambda r: r.blocks == expected)
        # Nothing else is cached: the next lines change nothing.
        time.sleep(1.5)
        for reader in early:
            assert reader.state() == expected
            assert reader.removed == []
            # Each shared block was stored once, though three prompts used it.
            assert len(reader.stored) == len(set(reader.stored)) == len(expected) - len(before)

        late = FeedReader(keyed.url, KEY)
        try:
            late.wait_for(lambda r: r.snapshot is not None, timeout=30)
            assert late.snapshot is not None
            assert dict(late.snapshot["blocks"]) == expected
        finally:
            late.close()
    finally:
        for reader in early:
            reader.close()


def test_an_idle_node_sends_heartbeats_with_its_load(keyed: Server) -> None:
    reader = FeedReader(keyed.url, KEY)
    try:
        reader.wait_for(lambda r: r.snapshot is not None, timeout=30)
        time.sleep(4)
        reader.check()
        arrivals = list(reader.arrivals)
        assert len(arrivals) >= 4
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        # The contract promises a line a second; the bound is generous for a busy machine,
        # and well below the 5 s after which a subscriber gives the feed up.
        assert max(gaps) < 2.5, gaps
        assert reader.load == {"running": 0, "waiting": 0, "kv_usage": 0.0}
    finally:
        reader.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 16 blocks of 16 tokens: two of the prompts below fill it.
    running = start_server(
        tmp_path_factory.mktemp("kv-events-small"),
        "--kv-cache-memory",
        "1MiB",
        "--max-model-len",
        "160",
    )
    yield running
    running.stop()


def predicted_hit_tokens(blocks: dict[str, str], tokens: list[int]) -> int:
    """Tokens of ``tokens`` the node finds cached, by the feed: its leading blocks present."""
    hit = 0
    for h in chain(tokens):
        if h not in blocks:
            break
        hit += BLOCK_SIZE
    return hit


def test_evictions_appear_as_removed_and_the_feed_predicts_every_hit(small: Server) -> None:
    reader = FeedReader(small.url)
    try:
        reader.wait_for(lambda r: r.snapshot is not None, timeout=30)
        assert reader.snapshot is not None and reader.snapshot["num_blocks"] == 16
        # A shared opening, then words of their own: partly cached, partly evicted.
        prompts = [SHARED + " ".join(f"word{i}x{j}" for j in range(14)) for i in range(5)]
        token_lists = [tokenize(small, p) for p in prompts]
        assert all(7 * BLOCK_SIZE <= len(t) <= 140 for t in token_lists), [
            len(t) for t in token_lists
        ]
        # Five prompts of 7+ blocks on 16 blocks, then the same backwards: each evicts, and
        # the second round finds the latest ones (and the shared opening) still cached.
        rounds = [*zip(token_lists, prompts, strict=True)]
        hits = []
        for tokens, prompt in rounds + rounds[::-1]:
            queries = small.metric("vllm:prefix_cache_queries_total")
            found = small.metric("vllm:prefix_cache_hits_total")
            predicted = predicted_hit_tokens(reader.state(), tokens)
            complete(small, prompt)
            target = queries + len(tokens)
            small.wait_until(
                lambda t=target: small.metric("vllm:prefix_cache_queries_total") >= t,
                what="the prefix-cache counters",
            )
            assert small.metric("vllm:prefix_cache_hits_total") - found == predicted
            hits.append(predicted)
            # Wait for this prompt's blocks: the feed is then current for the next prediction.
            reader.wait_for(lambda r, t=tokens: set(chain(t)) <= set(r.blocks))
        assert reader.removed, "a 16-block cache served 10 prompts of 7 blocks without evicting"
        stored = {h for h, _ in reader.stored}
        assert set(reader.removed) <= stored
        assert len(reader.state()) <= 16
        assert any(hits), hits  # a hit is predicted correctly, not only misses
        late = FeedReader(small.url)
        try:
            late.wait_for(lambda r: r.snapshot is not None, timeout=30)
            assert late.snapshot is not None
            # The late snapshot equals the early subscriber's map at the same point of the feed.
            reader.wait_for(lambda r: r.seq >= late.snapshot["seq"])  # type: ignore[index]
            assert dict(late.snapshot["blocks"]) == reader.history[late.snapshot["seq"]]
        finally:
            late.close()
    finally:
        reader.close()


@pytest.fixture
def draining(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A node of its own, with room for a request that outlasts the test: the drain below must
    still be waiting for it when the test asks the node for its feed."""
    running = start_server(tmp_path_factory.mktemp("kv-events-drain"))

    def feed_open() -> bool:
        # Ready before the scheduler's cache layout reaches the API server: until then the
        # feed answers 503 (starting).
        with httpx.stream("GET", f"{running.url}/v1/kv_events", timeout=10) as answer:
            return answer.status_code == 200

    running.wait_until(feed_open, what="the KV-events feed")
    yield running
    running.stop()


def test_the_feed_ends_when_the_node_drains(draining: Server) -> None:
    reader = FeedReader(draining.url)
    reader.wait_for(lambda r: r.snapshot is not None, timeout=30)
    stream = draining.client().completions.create(
        model=DEMO_MODEL,
        prompt="A long story begins",
        max_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # generating: the drain waits for it
    draining.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not reader.ended:
        assert time.monotonic() < deadline, "the feed kept going after the drain began"
        time.sleep(0.05)
    reader.check()
    answer = httpx.get(f"{draining.url}/v1/kv_events", timeout=10)
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "draining"
    assert answer.headers["Retry-After"] == "1"
    stream.close()  # the request in flight is aborted, which ends the drain
    assert draining.process.wait(60) == 0
