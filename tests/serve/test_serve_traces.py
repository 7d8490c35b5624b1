"""Request traces of a real node (``--otlp-traces-endpoint``) as a local OTLP/HTTP receiver
gets them: one ``llm_request`` span per engine request, its queue, prefill and decode phases as
child spans in order, its token counts as attributes; and a bad endpoint refused at start."""

from __future__ import annotations

import itertools
import subprocess
import time
from collections.abc import Iterator

import pytest

from pagedllm_testing.otlp_receiver import OtlpReceiver, Span
from pagedllm_testing.serve_harness import DEMO_MODEL, PAGEDLLM, Server, start_server


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    running = OtlpReceiver()
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Server]:
    base = f"http://127.0.0.1:{receiver.server.server_address[1]}"
    server = start_server(tmp_path_factory.mktemp("traces"), "--otlp-traces-endpoint", base)
    yield server
    server.stop()


def requests_of(receiver: OtlpReceiver, count: int) -> list[Span]:
    deadline = time.monotonic() + 30
    while True:
        roots = [s for s in receiver.snapshot() if s.name == "llm_request"]
        if len(roots) >= count or time.monotonic() > deadline:
            return roots
        time.sleep(0.1)


def test_one_span_per_request_with_its_phases_and_tokens(
    node: Server, receiver: OtlpReceiver
) -> None:
    client = node.client()
    single = client.completions.create(
        model=DEMO_MODEL, prompt="The harbour master wrote", max_tokens=12, temperature=0
    )
    sampled = client.completions.create(
        model=DEMO_MODEL,
        prompt="Four ships came in:",
        max_tokens=6,
        n=4,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    roots = requests_of(receiver, 2)
    assert len(roots) == 2, receiver.snapshot()
    assert all(path == "/v1/traces" for path in receiver.paths)
    by_tokens = {s.attributes["gen_ai.usage.completion_tokens"]: s for s in roots}
    first = by_tokens[single.usage.completion_tokens]
    assert first.attributes["gen_ai.usage.prompt_tokens"] == single.usage.prompt_tokens
    assert first.attributes["gen_ai.response.model"] == DEMO_MODEL
    assert first.attributes["gen_ai.request.max_tokens"] == 12
    assert first.resource["service.name"] == "pagedllm"
    fan_out = by_tokens[sampled.usage.completion_tokens]
    assert sampled.usage.completion_tokens == 24
    assert fan_out.attributes["gen_ai.request.n"] == 4
    for root in roots:
        assert root.end_ns > root.start_ns
        assert 0 < root.attributes["gen_ai.latency.time_to_first_token"]
        assert (
            root.attributes["gen_ai.latency.e2e"]
            >= (root.attributes["gen_ai.latency.time_to_first_token"])
        )
        phases = sorted(
            (s for s in receiver.snapshot() if s.parent_span_id == root.span_id),
            key=lambda s: s.start_ns,
        )
        assert [p.name for p in phases] == ["queue", "prefill", "decode"]
        assert all(p.trace_id == root.trace_id for p in phases)
        # Back to back, from the request's arrival to its end (clock conversion rounds).
        assert abs(phases[0].start_ns - root.start_ns) < 1_000_000
        assert abs(phases[-1].end_ns - root.end_ns) < 1_000_000
        for before, after in itertools.pairwise(phases):
            assert abs(before.end_ns - after.start_ns) < 1_000_000
        queue = phases[0]
        assert (
            abs(
                (queue.end_ns - queue.start_ns) / 1e9
                - root.attributes["gen_ai.latency.time_in_queue"]
            )
            < 1e-3
        )


def test_a_bad_endpoint_is_refused_at_start() -> None:
    done = subprocess.run(
        [PAGEDLLM, "serve", "--otlp-traces-endpoint", "collector:4318"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--otlp-traces-endpoint" in done.stderr and "http(s) URL" in done.stderr
