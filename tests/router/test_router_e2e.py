"""Two real `pagedllm serve` nodes behind a real `pagedllm router`, driven by the official
openai SDK: answers equal the nodes' own, requests sharing a prefix go where it is cached and
hit it there, a client that leaves aborts the node's work, the API key holds, and the router
answers 503 (or holds requests) when no node is ready."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm.api.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.api.tokenizing import TokenizingContext
from pagedllm.config import resolve_model_dir
from pagedllm.router.app import build_router_app
from pagedllm.router.feed import FeedFollower
from pagedllm.router.fleet import Backend, Fleet
from pagedllm.router.hashing import HashScheme, block_hashes
from pagedllm.router.metrics import RouterMetrics
from pagedllm.router.prompts import routing_tokens
from pagedllm.router.proxy import Forwarder
from pagedllm.router.residency import Residency
from pagedllm.router.routing import Router, RoutingSettings
from pagedllm.router.server import new_client_session
from pagedllm.router.state import RouterState
from pagedllm_testing.router_harness import ready_backends, start_router, wait_for
from pagedllm_testing.serve_harness import (
    DEMO_MODEL,
    TORCH_LIBRARY,
    Server,
    free_port,
    mapped_files,
    oversized_chunks,
    start_server,
)

KEY = "router-test-key"
GREEDY = {"temperature": 0.0}
# Prompts long enough to fill many blocks; each test uses its own words.
FILLER = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"


def long_prompt(topic: str, words: int = 400) -> str:
    base = FILLER.split()
    return f"{topic}: " + " ".join(base[(i * 7) % len(base)] + str(i % 13) for i in range(words))


@pytest.fixture(scope="module")
def model_dir() -> str:
    return resolve_model_dir(None)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    started: list[Server] = []
    try:
        for i in range(2):
            started.append(start_server(tmp_path_factory.mktemp(f"node{i}"), api_key=KEY))
        yield started
    finally:
        for node in started:
            node.stop()


@pytest.fixture(scope="module")
def router(
    tmp_path_factory: pytest.TempPathFactory, model_dir: str, nodes: list[Server]
) -> Iterator[Server]:
    running = start_router(
        tmp_path_factory.mktemp("router"),
        model_dir,
        [n.url for n in nodes],
        "--served-model-name",
        DEMO_MODEL,
        api_key=KEY,
    )
    wait_for(lambda: ready_backends(running) == 2, running, "both nodes' feeds")
    yield running
    running.stop()


def router_tokens(router: Server, prompt: str) -> list[int]:
    """The prompt's tokens, as the router's /tokenize gives them."""
    answer = httpx.post(
        f"{router.url}/tokenize",
        json={"prompt": prompt},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    return answer.json()["tokens"]


def served(node: Server) -> float:
    return node.metric("vllm:request_success_total")


def test_answers_through_the_router_equal_the_nodes_own(
    router: Server, nodes: list[Server]
) -> None:
    direct, routed = nodes[0].client(), router.client()
    args = {"model": DEMO_MODEL, "prompt": "Ships sail at dawn", "max_tokens": 12, **GREEDY}
    want = direct.completions.create(**args)
    got = routed.completions.create(**args)
    assert got.choices[0].text == want.choices[0].text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    chunks = list(routed.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text

    messages = [{"role": "user", "content": "Describe the harbour"}]
    chat_args = {"model": DEMO_MODEL, "messages": messages, "max_completion_tokens": 10, **GREEDY}
    want_chat = direct.chat.completions.create(**chat_args)
    got_chat = routed.chat.completions.create(**chat_args)
    assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
    streamed = list(
        routed.chat.completions.create(
            **chat_args, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == want_chat.choices[0].message.content
    assert streamed[-1].usage.completion_tokens == want_chat.usage.completion_tokens


def test_errors_come_back_in_the_nodes_shape(router: Server, nodes: list[Server]) -> None:
    client = router.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=DEMO_MODEL, prompt="x", max_tokens=1, top_p=0)
    assert bad.value.body["param"] == "top_p"  # the router's own validation, as a node's
    with pytest.raises(openai.NotFoundError):  # the node's answer, relayed
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    too_big = httpx.post(
        f"{router.url}/v1/completions",
        content=b"x" * (9 << 20),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(
        f"{router.url}/v1/completions",
        content=oversized_chunks(DEMO_MODEL),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    # What is refused before any routing, as a node refuses it.
    auth = {"Authorization": f"Bearer {KEY}"}
    for target in (router, nodes[0]):
        not_json = httpx.post(
            f"{target.url}/v1/completions",
            content=b'{"prompt": ',
            headers=auth | {"Content-Type": "application/json"},
        )
        assert not_json.status_code == 400, not_json.text
        assert not_json.json()["error"]["type"] == "invalid_request_error"
        wrong_method = httpx.get(f"{target.url}/v1/chat/completions", headers=auth)
        assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
        assert wrong_method.json()["error"]["type"] == "invalid_request_error"


def test_the_api_key_is_enforced(router: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        router.client(api_key="wrong").completions.create(
            model=DEMO_MODEL, prompt="x", max_tokens=1
        )
    assert httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{router.url}/v1/models").status_code == 401
    # Probes and scrapers stay open, as on a node.
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{router.url}{path}").status_code == 200
    models = router.client().models.list()
    assert [m.id for m in models.data] == [DEMO_MODEL]


def test_requests_go_where_their_prefix_is_cached_and_hit_it(
    router: Server, nodes: list[Server]
) -> None:
    """A prompt sent straight to one node is cached there; the router then sends requests
    sharing it to that node, whichever it is, and the node's prefix cache hits."""
    for index, topic in enumerate(["lighthouses", "glaciers"]):
        holder, other = nodes[index], nodes[1 - index]
        prefix = long_prompt(topic)
        prompt_blocks = len(router_tokens(router, prefix)) // 16
        cached_before = router.metric("pagedllm:router_backend_cached_blocks", backend=holder.url)
        holder.client().completions.create(model=DEMO_MODEL, prompt=prefix, max_tokens=1)
        hits = holder.metric("vllm:prefix_cache_hits_total")
        holder_served, other_served = served(holder), served(other)
        routed_by_prefix = router.metric("pagedllm:router_requests_routed_total", reason="prefix")
        wait_for(
            lambda h=holder, c=cached_before, n=prompt_blocks: (
                router.metric("pagedllm:router_backend_cached_blocks", backend=h.url) >= c + n
            ),
            router,
            "the holder's feed to report the prompt's blocks",
        )
        client = router.client()
        for question in range(4):
            client.completions.create(
                model=DEMO_MODEL, prompt=f"{prefix} question {question}?", max_tokens=2
            )
        assert served(holder) == holder_served + 4
        assert served(other) == other_served
        assert (
            router.metric("pagedllm:router_requests_routed_total", reason="prefix")
            == routed_by_prefix + 4
        )
        # Every request found the shared prompt's full blocks cached.
        hit = holder.metric("vllm:prefix_cache_hits_total") - hits
        assert hit >= 4 * prompt_blocks * 16 - 4 * 16


def test_a_prompt_cached_nowhere_lands_with_its_twins(router: Server, nodes: list[Server]) -> None:
    """Identical system prompts sent at once, before any is cached, go to one node (two of
    them: a third at once would put that node over the load bound of 1.25 x the mean)."""
    before = [served(n) for n in nodes]
    messages = [
        {"role": "system", "content": long_prompt("a fresh system prompt about orchards")},
        {"role": "user", "content": "Which tree?"},
    ]
    client = router.client()
    threads = [
        threading.Thread(
            target=client.chat.completions.create,
            kwargs={"model": DEMO_MODEL, "messages": messages, "max_completion_tokens": 2},
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grown = sorted(served(n) - b for n, b in zip(nodes, before, strict=True))
    assert grown == [0, 2]


def test_a_client_that_leaves_aborts_the_request_upstream(
    router: Server, nodes: list[Server]
) -> None:
    aborted = sum(n.metric("vllm:request_success_total", finished_reason="abort") for n in nodes)
    body = {"model": DEMO_MODEL, "prompt": "Never read", "max_tokens": 1500, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    # A whole-response request: the client gives up while the node generates.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=1.0)
    # A stream: the client reads its first events, then hangs up.
    with httpx.stream(
        "POST", f"{router.url}/v1/completions", json={**body, "stream": True}, headers=headers
    ) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    wait_for(
        lambda: sum(n.metric("vllm:num_requests_running") for n in nodes) == 0,
        router,
        "the abandoned requests to be aborted",
        timeout=20,
    )
    total = sum(n.metric("vllm:request_success_total", finished_reason="abort") for n in nodes)
    assert total == aborted + 2
    wait_for(
        lambda: router.metric("pagedllm:router_backend_in_flight") == 0,
        router,
        "the router to see both requests end",
    )


def test_the_router_never_loads_torch(router: Server) -> None:
    files = mapped_files(router.process.pid)
    assert any("tokenizers" in f for f in files)  # the process that tokenizes
    assert [f for f in files if TORCH_LIBRARY.search(f) or "/torch/" in f] == []


def test_no_ready_node_is_a_503_and_the_router_stays_healthy(
    tmp_path: Path, model_dir: str
) -> None:
    router = start_router(tmp_path / "router", model_dir, [f"http://127.0.0.1:{free_port()}"])
    try:
        answer = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["type"] == "service_unavailable_error"
        assert router.health() == 200
        assert router.metric("pagedllm:router_requests_rejected_total", reason="no_backend") == 1
    finally:
        router.stop()


def test_held_requests_wait_for_a_node_to_become_ready(tmp_path: Path, model_dir: str) -> None:
    port = free_port()
    router = start_router(
        tmp_path / "router",
        model_dir,
        [f"http://127.0.0.1:{port}"],
        "--max-held-requests",
        "2",
        "--hold-timeout",
        "300",
    )
    node: Server | None = None
    results: list[int] = []
    try:

        def ask() -> None:
            answer = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": DEMO_MODEL, "prompt": "held", "max_tokens": 2},
                timeout=300,
            )
            results.append(answer.status_code)

        waiting = [threading.Thread(target=ask) for _ in range(2)]
        for t in waiting:
            t.start()
        wait_for(
            lambda: router.metric("pagedllm:router_held_requests") == 2, router, "two held requests"
        )
        # A third is over --max-held-requests: refused at once.
        third = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert third.status_code == 503 and third.json()["error"]["code"] == "hold_full"
        node = start_server(tmp_path / "late-node", port=port)
        for t in waiting:
            t.join(timeout=120)
        assert results == [200, 200]
    finally:
        router.stop()
        if node is not None:
            node.stop()


def test_a_refusing_node_is_skipped_before_the_first_byte(
    nodes: list[Server], tokenizing: TokenizingContext
) -> None:
    """The router app, in this process, believes a node that refuses connections holds the
    prompt: the request goes there first, is refused, and is answered by the live node."""
    dead_url = f"http://127.0.0.1:{free_port()}"
    live = nodes[0]
    prompt = long_prompt("refusals")

    async def scenario() -> tuple[int, str, dict[str, float]]:
        async def no_feed(backend: Backend, fleet: Fleet) -> None:
            return None

        fleet = Fleet(no_feed)
        fleet.set_backends([dead_url, live.url])
        tokens = tokenizing.tokenizer.encode(prompt)
        scheme = HashScheme(16, 0)
        fleet.backends[dead_url].residency = Residency(scheme, set(block_hashes(tokens, scheme)))
        fleet.backends[live.url].residency = Residency(scheme)
        metrics = RouterMetrics(fleet)
        async with new_client_session() as client:
            state = RouterState(
                ctx=tokenizing,
                router=Router(fleet, RoutingSettings(), metrics),
                forwarder=Forwarder(client, fleet, metrics, KEY),
                metrics=metrics,
            )
            app = build_router_app(state, None)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as front:
                answer = await front.post(
                    "/v1/completions",
                    json={"model": DEMO_MODEL, "prompt": prompt, "max_tokens": 3},
                )
            await fleet.close()
        scraped = {
            f"{s.name}{s.labels}": s.value
            for family in metrics.registry.collect()
            for s in family.samples
        }
        return answer.status_code, answer.text, scraped

    before = served(live)
    status, text, scraped = asyncio.run(scenario())
    assert status == 200, text
    assert served(live) == before + 1
    assert (
        scraped[
            "pagedllm:router_upstream_errors_total" + str({"backend": dead_url, "kind": "connect"})
        ]
        == 1
    )
    assert scraped["pagedllm:router_requests_routed_total" + str({"reason": "prefix"})] == 1


def test_the_router_drains_on_sigterm(tmp_path: Path, model_dir: str, nodes: list[Server]) -> None:
    router = start_router(
        tmp_path, model_dir, [n.url for n in nodes], "--shutdown-timeout", "300", api_key=KEY
    )
    wait_for(lambda: ready_backends(router) == 2, router, "both nodes' feeds")
    body = {"model": DEMO_MODEL, "prompt": "Drain me", "max_tokens": 300, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST",
        f"{router.url}/v1/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=300,
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        router.process.send_signal(signal.SIGTERM)
        wait_for(lambda: router.health() == 503, router, "/health to turn 503")
        rest = list(lines)
    assert "data: [DONE]" in rest  # the stream in flight ran to its end
    assert router.process.wait(60) == 0


def test_the_feed_reports_the_hashes_the_router_computes(
    nodes: list[Server], tokenizing: TokenizingContext
) -> None:
    """Followed in this process: each node's feed, after a completion and a chat request
    straight to the node, holds exactly the block hashes the router computes for their
    prompts; set_backends adds and drops subscriptions."""
    node = nodes[0]
    completion = CompletionRequest(prompt=long_prompt("feeds", 150))
    chat = ChatCompletionRequest(
        messages=[
            {"role": "system", "content": long_prompt("a chat about feeds", 120)},
            {"role": "user", "content": "Is it exact?"},
        ]
    )
    for body in (completion, chat):
        payload = body.model_dump(exclude_none=True) | {"model": DEMO_MODEL, "max_tokens": 1}
        answer = httpx.post(
            f"{node.url}{'/v1/chat/completions' if body is chat else '/v1/completions'}",
            json=payload,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text

    async def scenario() -> tuple[list[int], list[int], list[str], list[str]]:
        async with new_client_session() as client:
            fleet = Fleet(FeedFollower(client, {"authorization": f"Bearer {KEY}"}))
            fleet.set_backends([n.url for n in nodes])
            ready = await fleet.wait_ready(60)
            for _ in range(100):  # both feeds
                if len(fleet.ready()) == 2:
                    break
                await asyncio.sleep(0.1)
            backend = fleet.backends[node.url]
            assert backend.residency is not None and ready
            scheme = backend.residency.scheme
            found, wanted = [], []
            for body in (completion, chat):
                tokens = await routing_tokens(tokenizing, body)
                hashes = block_hashes(tokens, scheme)
                found.append(backend.residency.cached_blocks(hashes))
                wanted.append(len(hashes))
            fleet.set_backends([nodes[1].url])
            after_drop = sorted(fleet.backends)
            fleet.set_backends([n.url for n in nodes])
            readded = [b.url for b in await fleet.wait_ready(60)]
            await fleet.close()
            return found, wanted, after_drop, readded

    found, wanted, after_drop, readded = asyncio.run(scenario())
    assert found == wanted and min(wanted) >= 8
    assert after_drop == [nodes[1].url]
    assert nodes[1].url in readded


def test_a_killed_node_is_skipped(router: Server, nodes: list[Server]) -> None:
    """Last: it kills a node. Requests whose prefix the dead node held are served by the
    other, whether the router noticed from the feed or from a refused connection."""
    doomed, survivor = nodes[1], nodes[0]
    prefix = long_prompt("volcanoes")
    doomed.client().completions.create(model=DEMO_MODEL, prompt=prefix, max_tokens=1)
    wait_for(
        lambda: router.metric("pagedllm:router_backend_cached_blocks", backend=doomed.url) > 0,
        router,
        "the doomed node's blocks",
    )
    os.killpg(doomed.process.pid, signal.SIGKILL)
    before = served(survivor)
    client = router.client()
    for question in range(3):
        answer = client.completions.create(
            model=DEMO_MODEL, prompt=f"{prefix} {question}?", max_tokens=2
        )
        assert answer.choices[0].finish_reason == "length"
    assert served(survivor) == before + 3
    wait_for(lambda: ready_backends(router) == 1, router, "the dead node to be dropped")
    assert router.health() == 200
