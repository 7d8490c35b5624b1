"""Quiet resyncs: with 200 PagedLLMs settled, a resync writes nothing and reads one list per
child kind, counted at the emulator; a spec change afterwards still reaches its child, and
only that one."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedllm_testing.emulator.requests import RecordedRequest, RequestLog
from pagedllm_testing.operator_harness import (
    KOPF_RUN,
    PLLM,
    EmulatorThread,
    Kube,
    OperatorProcess,
    pagedllm,
)
from pagedllm_testing.polling import eventually as _eventually

COUNT = 200
RESYNCS = 3
RESYNC_SECONDS = 2.0
ENV = {
    "PAGEDLLM_OPERATOR_RESYNC_SECONDS": str(RESYNC_SECONDS),
    # Fewer watch restarts and discovery lookups: the counts are about the resync.
    "PAGEDLLM_OPERATOR_WATCH_TIMEOUT_SECONDS": "120",
    "PAGEDLLM_OPERATOR_DISCOVERY_CACHE_SECONDS": "3600",
}
# The test's own requests (httpx); everything else the emulator serves comes from the
# operator process (its API client and kopf).
TEST_AGENT = "python-httpx/"

slow_poll = functools.partial(_eventually, interval=0.5)


@pytest.fixture(scope="module")
def operator_process(
    kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory, crd: dict[str, Any]
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator"), KOPF_RUN, ENV)
    process.start()
    yield process
    if process.process is not None:
        process.stop()


def by_operator(records: list[RecordedRequest]) -> list[RecordedRequest]:
    return [r for r in records if not r.agent.startswith(TEST_AGENT)]


def resync_starts(
    log: RequestLog, since: int, count: int, starts_resync: Callable[[RecordedRequest], bool]
) -> list[int]:
    """Where in the log the next `count` resyncs begin, waiting for them."""

    def found() -> list[int] | None:
        starts = [since + i for i, r in enumerate(log.since(since)) if starts_resync(r)]
        return starts[:count] if len(starts) >= count else None

    return slow_poll(found, timeout=60 + 30 * count, what=f"{count} resyncs")


def quiet_resync(
    log: RequestLog, since: int, starts_resync: Callable[[RecordedRequest], bool]
) -> int:
    """Where the first resync after `since` that wrote nothing ends: settled (children's own
    events may still echo for a resync or two after the statuses are in)."""
    first = resync_starts(log, since, 1, starts_resync)[0]
    for _ in range(3):
        try:
            second = resync_starts(log, first + 1, 1, starts_resync)[0]
        except AssertionError:
            break  # a resync this long is not a quiet one
        if not any(r.mutating for r in by_operator(log.records[first:second])):
            return second
        first = second
    window = by_operator(log.since(first))
    writes = Counter(f"{r.method} {r.path}" for r in window if r.mutating)
    raise AssertionError(
        f"no resync without writes: the last one (finished or not) sent "
        f"{sum(writes.values())} writes, e.g. {list(writes)[:3]}, among {len(window)} requests"
    )


def lists_deployments_of(namespace: str) -> Callable[[RecordedRequest], bool]:
    """A resync begins with one list per child kind per namespace, Deployments first."""
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    return lambda r: r.method == "GET" and not r.watch and r.path == path


def shape(path: str, namespace: str) -> str:
    """A path with the object's name left out, to sum calls per kind."""
    parts = path.split("/")
    if namespace not in parts:
        return path
    at = parts.index(namespace)
    parts[at] = "NS"
    if len(parts) > at + 2:
        parts[at + 2] = "NAME"
    return "/".join(parts)


def settled(kube: Kube, namespace: str) -> bool:
    items = kube.list(f"{PLLM}/namespaces/{namespace}/pagedllms")
    return len(items) == COUNT and all(
        (item.get("status") or {}).get("observedGeneration") == item["metadata"]["generation"]
        for item in items
    )


def test_steady_state_resyncs_write_nothing(
    emulator: EmulatorThread,
    kube: Kube,
    namespace: str,
    operator_process: OperatorProcess,
    record_property: Callable[[str, object], None],
) -> None:
    log = emulator.server.requests
    collection = f"{PLLM}/namespaces/{namespace}/pagedllms"
    for index in range(COUNT):
        name = f"m{index:03d}"
        kube.create(collection, pagedllm(name, {"model": {"servedName": name}}))
    slow_poll(lambda: settled(kube, namespace), timeout=400, what="every PagedLLM's status")

    starts_resync = lists_deployments_of(namespace)
    second = quiet_resync(log, len(log), starts_resync)
    cpu_before = operator_process.cpu_seconds()
    starts = resync_starts(log, second, RESYNCS + 1, starts_resync)
    cpu = operator_process.cpu_seconds() - cpu_before
    window = by_operator(log.records[starts[0] : starts[-1]])
    mutating = Counter(f"{r.method} {shape(r.path, namespace)}" for r in window if r.mutating)
    reads = Counter(f"GET {shape(r.path, namespace)}" for r in window if r.verb == "GET")
    reads_per_resync = sum(reads.values()) / RESYNCS
    print(
        f"\n{COUNT} PagedLLMs, {RESYNCS} resyncs: {sum(mutating.values())} writes, "
        f"{reads_per_resync:g} reads per resync ({reads_per_resync / COUNT:.3f} per "
        f"PagedLLM), operator CPU {cpu / RESYNCS:.3f} s per resync\n"
        f"reads: {dict(reads)}\nwrites: {dict(mutating)}"
    )
    record_property("reads_per_resync_per_pagedllm", reads_per_resync / COUNT)
    record_property("cpu_seconds_per_resync", cpu / RESYNCS)
    assert not mutating, f"writes at steady state: {dict(mutating)}"
    # One list per child kind and one of pods (8), not a call per PagedLLM or per child; the
    # lists run concurrently, so the window's edges may cut a resync's lists in two.
    assert reads_per_resync <= 16, dict(reads)

    # A spec change still reaches the children: exactly the one it changes.
    since = len(log)
    target = f"{collection}/m007"
    router = f"/apis/apps/v1/namespaces/{namespace}/deployments/m007-router"
    kube.merge(target, {"spec": {"router": {"replicas": 3}}})
    slow_poll(
        lambda: kube.get(router)["spec"]["replicas"] == 3, timeout=60, what="the router scaled"
    )
    later = resync_starts(log, len(log), 2, starts_resync)
    written = {r.path for r in by_operator(log.records[since : later[-1]]) if r.mutating}
    assert {path for path in written if not path.startswith(target)} == {router}

    # A child changed by hand is put back by the next resync (Services raise no events the
    # operator reconciles on: the resync's comparison is what finds it).
    service = f"/api/v1/namespaces/{namespace}/services/m008"
    port = kube.get(service)["spec"]["ports"][0]["port"]
    kube.merge(service, {"spec": {"ports": [{"name": "http", "port": port + 1}]}})
    slow_poll(
        lambda: kube.get(service)["spec"]["ports"][0]["port"] == port,
        timeout=60,
        what="the resync to restore the Service",
    )
