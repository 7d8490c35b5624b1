"""Quiet resyncs: with COUNT PagedLLMs settled, a resync writes nothing and reads one list per
child kind, counted in the real kube-apiserver's audit log (the operator's requests are those
with its client's and kopf's User-Agents); a spec change afterwards still reaches its child, and
only that one."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from pagedllm.operator.kube import FIELD_MANAGER
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.operator_harness import (
    KOPF_RUN,
    PLLM,
    AuditLog,
    Kube,
    OperatorProcess,
    pagedllm,
)
from pagedllm_testing.polling import eventually as _eventually

COUNT = 80
RESYNCS = 3
RESYNC_SECONDS = 2.0
ENV = {
    "PAGEDLLM_OPERATOR_RESYNC_SECONDS": str(RESYNC_SECONDS),
    # Fewer watch restarts and discovery lookups: the counts are about the resync.
    "PAGEDLLM_OPERATOR_WATCH_TIMEOUT_SECONDS": "120",
    "PAGEDLLM_OPERATOR_DISCOVERY_CACHE_SECONDS": "3600",
}
MUTATING = {"create", "update", "patch", "delete", "deletecollection"}
# The test's own requests (httpx); the operator's come from its client and kopf.
TEST_AGENT = "python-httpx/"

slow_poll = functools.partial(_eventually, interval=0.5)

Event = dict[str, Any]


@pytest.fixture(scope="module")
def operator_process(
    kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory, crd: dict[str, Any]
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator"), KOPF_RUN, ENV)
    process.start()
    yield process
    if process.process is not None:
        process.stop()


def received(event: Event) -> datetime:
    return datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))


def by_operator(audit: AuditLog) -> list[Event]:
    """The operator's finished requests so far (its API client's and kopf's), in the order
    the apiserver received them."""
    return sorted(
        (
            e
            for e in audit.read()
            if e["stage"] == "ResponseComplete"
            and (e["userAgent"] == FIELD_MANAGER or e["userAgent"].startswith("kopf/"))
        ),
        key=received,
    )


def between(events: list[Event], start: datetime, end: datetime | None = None) -> list[Event]:
    return [e for e in events if start <= received(e) and (end is None or received(e) < end)]


def lists_deployments_of(namespace: str) -> Callable[[Event], bool]:
    """A resync begins with one list per child kind per namespace, Deployments first."""
    return lambda e: (
        e["userAgent"] == FIELD_MANAGER
        and e["verb"] == "list"
        and e.get("objectRef", {}).get("resource") == "deployments"
        and e["objectRef"].get("namespace") == namespace
    )


def resync_starts(
    audit: AuditLog, since: datetime, count: int, starts_resync: Callable[[Event], bool]
) -> list[datetime]:
    """When the next `count` resyncs after `since` began, waiting for them."""

    def found() -> list[datetime] | None:
        starts = [received(e) for e in between(by_operator(audit), since) if starts_resync(e)]
        return starts[:count] if len(starts) >= count else None

    return slow_poll(found, timeout=60 + 30 * count, what=f"{count} resyncs")


def writes(events: list[Event]) -> list[Event]:
    return [e for e in events if e["verb"] in MUTATING]


def kind(event: Event) -> str:
    """The event's verb and resource, the object's name left out, to sum calls per kind."""
    ref = event.get("objectRef") or {}
    resource = ref.get("resource", event["requestURI"])
    if ref.get("subresource"):
        resource += "/" + ref["subresource"]
    return f"{event['verb']} {resource}"


def quiet_resync(
    audit: AuditLog, since: datetime, starts_resync: Callable[[Event], bool]
) -> datetime:
    """When the first resync after `since` that wrote nothing ended: settled (children's own
    events may still echo for a resync or two after the statuses are in)."""
    first = resync_starts(audit, since, 1, starts_resync)[0]
    for _ in range(3):
        try:
            second = resync_starts(audit, first, 2, starts_resync)[1]
        except AssertionError:
            break  # a resync this long is not a quiet one
        if not writes(between(by_operator(audit), first, second)):
            return second
        first = second
    window = between(by_operator(audit), first)
    found = Counter(kind(e) for e in writes(window))
    raise AssertionError(
        f"no resync without writes: the last one (finished or not) sent "
        f"{sum(found.values())} writes, e.g. {list(found)[:3]}, among {len(window)} requests"
    )


def settled(kube: Kube, namespace: str) -> bool:
    items = kube.list(f"{PLLM}/namespaces/{namespace}/pagedllms")
    return len(items) == COUNT and all(
        (item.get("status") or {}).get("observedGeneration") == item["metadata"]["generation"]
        for item in items
    )


def test_steady_state_resyncs_write_nothing(
    cluster: ControlPlane,
    kube: Kube,
    namespace: str,
    operator_process: OperatorProcess,
    record_property: Callable[[str, object], None],
) -> None:
    """Settled, RESYNCS resyncs write nothing and read a list per child kind; then a spec
    change writes exactly its child, and a child changed by hand is put back."""
    audit = AuditLog(cluster)
    collection = f"{PLLM}/namespaces/{namespace}/pagedllms"
    for index in range(COUNT):
        name = f"m{index:03d}"
        kube.create(collection, pagedllm(name, {"model": {"servedName": name}}))
    slow_poll(lambda: settled(kube, namespace), timeout=400, what="every PagedLLM's status")

    starts_resync = lists_deployments_of(namespace)
    second = quiet_resync(audit, datetime.min.replace(tzinfo=timezone.utc), starts_resync)
    cpu_before = operator_process.cpu_seconds()
    starts = resync_starts(audit, second, RESYNCS + 1, starts_resync)
    cpu = operator_process.cpu_seconds() - cpu_before
    window = between(by_operator(audit), starts[0], starts[-1])
    mutating = Counter(kind(e) for e in writes(window))
    reads = Counter(kind(e) for e in window if e["verb"] in ("get", "list"))
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
    kube.merge(f"{collection}/m007", {"spec": {"router": {"replicas": 3}}})
    since = max(
        received(e)
        for e in audit.read()
        if e["userAgent"].startswith(TEST_AGENT)
        and e["verb"] == "patch"
        and e.get("objectRef", {}).get("name") == "m007"
    )
    router = f"/apis/apps/v1/namespaces/{namespace}/deployments/m007-router"
    slow_poll(
        lambda: kube.get(router)["spec"]["replicas"] == 3, timeout=60, what="the router scaled"
    )
    later = resync_starts(audit, since, 2, starts_resync)
    written = {
        (e["objectRef"]["resource"], e["objectRef"]["name"])
        for e in writes(between(by_operator(audit), since, later[-1]))
    }
    assert {w for w in written if w != ("pagedllms", "m007")} == {("deployments", "m007-router")}

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
