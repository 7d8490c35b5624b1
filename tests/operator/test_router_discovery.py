"""The router's Kubernetes discovery against the real kube-apiserver: EndpointSlices as the
EndpointSlice controller writes them (the test writes them, as envtest's tests do), listed and
watched through the `kubernetes` package with credentials from a kubeconfig (as a router
outside a pod finds them)."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from kubernetes.client.exceptions import ApiException

from pagedllm.router.discovery import (
    USER_AGENT,
    DiscoveryError,
    DiscoveryTarget,
    EndpointSliceDiscovery,
    _Expired,
    load_api_client,
    ready_urls,
    slice_urls,
)
from pagedllm_testing.cluster.control_plane import ADMIN_USER, ControlPlane, kubeconfig_text
from pagedllm_testing.operator_harness import (
    SERVICE,
    AuditLog,
    Kube,
    TcpProxy,
    endpoint,
    endpoint_slice,
    eventually,
)


def test_slice_urls_takes_ready_endpoints_on_the_named_port() -> None:
    one = endpoint_slice(
        "a",
        [
            endpoint("10.0.0.1"),
            endpoint("10.0.0.2", ready=False, terminating=True),
            endpoint("10.0.0.3", ready=None),  # unknown: counts as ready
            {"addresses": [], "conditions": {"ready": True}},
        ],
    )
    assert slice_urls(one, "http") == {"http://10.0.0.1:8000", "http://10.0.0.3:8000"}
    assert slice_urls(one, "metrics") == set()
    six = endpoint_slice("b", [endpoint("fd00::1")], address_type="IPv6")
    assert slice_urls(six, "http") == {"http://[fd00::1]:8000"}
    assert slice_urls({**one, "ports": [{"name": "http", "port": None}]}, "http") == set()
    # Malformed slices (an API server would refuse them) are ignored, never a crash.
    for broken in (
        {**one, "ports": "http"},
        {**one, "ports": [{"name": "http", "port": 0}]},
        {**one, "ports": [{"name": "http", "port": True}]},
        {**one, "addressType": None},
        {**one, "endpoints": {"addresses": ["10.0.0.1"]}},
    ):
        assert slice_urls(broken, "http") == set(), broken
    odd = {**one, "endpoints": [{"addresses": "10.0.0.1"}, {"addresses": [7]}, "x", {}]}
    assert slice_urls(odd, "http") == set()
    # A pod in two slices while the controller moves it is one backend.
    assert ready_urls([one, {**one, "metadata": {"name": "c"}}], "http") == [
        "http://10.0.0.1:8000",
        "http://10.0.0.3:8000",
    ]


def test_no_credentials_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(DiscoveryError, match="no Kubernetes credentials"):
        load_api_client()


class Seen:
    """What on_change was called with, awaited from the test's event loop."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, urls: list[str]) -> None:
        self.calls.append(urls)

    async def until(self, expected: list[str], timeout: float = 15) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.calls or self.calls[-1] != expected:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"discovery saw {self.calls}, never {expected}")
            await asyncio.sleep(0.05)


@pytest.fixture
def slices_path(kube: Kube, namespace: str) -> str:
    return f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def discovery_from_kubeconfig(
    kubeconfig: Path, monkeypatch: pytest.MonkeyPatch, namespace: str, **options: Any
) -> EndpointSliceDiscovery:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return EndpointSliceDiscovery(DiscoveryTarget(namespace, SERVICE), **options)


def run_with_discovery(
    discovery: EndpointSliceDiscovery, body: Callable[[Seen], Any]
) -> list[list[str]]:
    seen = Seen()

    async def main() -> None:
        task = asyncio.create_task(discovery.run(seen))
        try:
            await body(seen)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    return seen.calls


def watches_of(audit: AuditLog, namespace: str) -> int:
    """How many watches of the namespace's EndpointSlices discovery has opened since `audit`
    was made."""
    return sum(
        1
        for e in audit.read()
        if e["userAgent"] == USER_AGENT
        and e["verb"] == "watch"
        and e["stage"] == "ResponseStarted"
        and e.get("objectRef", {}).get("resource") == "endpointslices"
        and e["objectRef"].get("namespace") == namespace
    )


def test_follows_the_services_ready_endpoints(
    cluster: ControlPlane,
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    slices_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ready endpoints on the named port of the Service's slices, followed through slices
    created, changed and deleted, each change on a watch resumed after the server ended the
    one before."""
    audit = AuditLog(cluster)
    kube.create(
        slices_path,
        endpoint_slice("a", [endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=False)]),
    )
    # Another Service's slice and a slice without the API port are not backends.
    kube.create(slices_path, endpoint_slice("other", [endpoint("10.9.9.9")], service="other"))
    kube.create(slices_path, endpoint_slice("noport", [endpoint("10.0.0.7")], port_name="x"))
    # Watches that the server ends every second: each change below lands on a resumed one.
    discovery = discovery_from_kubeconfig(
        kubeconfig, monkeypatch, namespace, watch_timeout_seconds=1
    )

    async def changes(seen: Seen) -> None:
        await seen.until(["http://10.0.0.1:8000"])
        await asyncio.to_thread(
            eventually, lambda: watches_of(audit, namespace) >= 2, what="a resumed watch"
        )
        kube.create(slices_path, endpoint_slice("b", [endpoint("10.0.0.3")], port=9000))
        await seen.until(["http://10.0.0.1:8000", "http://10.0.0.3:9000"])
        kube.merge(
            f"{slices_path}/a",
            {"endpoints": [endpoint("10.0.0.1", ready=False, terminating=True)]},
        )
        await seen.until(["http://10.0.0.3:9000"])
        kube.delete(f"{slices_path}/b")
        await seen.until([])
        kube.merge(f"{slices_path}/a", {"endpoints": [endpoint("10.0.0.4")]})
        await seen.until(["http://10.0.0.4:8000"])

    calls = run_with_discovery(discovery, changes)
    # Only changes are reported, each set once.
    assert all(before != after for before, after in itertools.pairwise(calls))


def test_waits_for_an_unreachable_api_then_follows_it(
    cluster: ControlPlane,
    kube: Kube,
    namespace: str,
    slices_path: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A router whose API server cannot be reached keeps retrying instead of failing, and a
    router started before its Service has endpoints hears about them later. The kubeconfig
    names a port where nothing listens until a forwarder to the apiserver opens there."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "config"
    config.write_text(
        kubeconfig_text(f"https://127.0.0.1:{port}", cluster.ca, ADMIN_USER, client=cluster.admin)
    )
    discovery = discovery_from_kubeconfig(
        config, monkeypatch, namespace, watch_timeout_seconds=1, max_backoff_seconds=0.5
    )
    address = urlsplit(cluster.server)

    def retries() -> int:
        failed = f"discovery of {namespace}/{SERVICE} failed, retrying"
        return sum(1 for record in caplog.records if record.getMessage().startswith(failed))

    async def changes(seen: Seen) -> None:
        await asyncio.to_thread(eventually, lambda: retries() >= 3, what="refused attempts")
        assert seen.calls == []
        with TcpProxy((address.hostname or "127.0.0.1", address.port or 443), port=port):
            await seen.until([])
            kube.create(slices_path, endpoint_slice("a", [endpoint("10.0.0.1")]))
            await seen.until(["http://10.0.0.1:8000"])

    run_with_discovery(discovery, changes)


def test_an_expired_watch_means_listing_again(
    cluster: ControlPlane,
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    slices_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A watch resumed from a resourceVersion the apiserver's watch cache no longer reaches
    back to (it started over, from a list at a later version, when the apiserver restarted)
    is answered 410 Gone, which discovery takes as its cue to list again."""
    discovery = discovery_from_kubeconfig(kubeconfig, monkeypatch, namespace)
    kube.create(slices_path, endpoint_slice("a", [endpoint("10.0.0.1")]))
    slices, version = discovery._list()
    assert list(slices) == ["a"]
    # Writes after the list move the cluster's resourceVersion past it.
    for index in range(3):
        kube.create(
            f"/api/v1/namespaces/{namespace}/configmaps", {"metadata": {"name": f"c-{index}"}}
        )
    cluster.stop("kube-apiserver")
    cluster.up()

    def expired() -> bool:
        try:
            discovery._watch(slices, version, lambda urls: None, threading.Event())
        except _Expired:
            return True
        except ApiException as error:
            if error.status == 429:  # the watch cache still filling after the restart
                return False
            raise
        raise AssertionError(f"a watch from {version} was served after the restart")

    eventually(expired, what="410 Gone for the watch")
