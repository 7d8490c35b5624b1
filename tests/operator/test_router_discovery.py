"""The router's Kubernetes discovery against the API emulator: EndpointSlices as the
EndpointSlice controller writes them, listed and watched through the `kubernetes` package
with credentials from a kubeconfig (as a router outside a pod finds them)."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm.router.discovery import (
    SERVICE_NAME_LABEL,
    DiscoveryError,
    DiscoveryTarget,
    EndpointSliceDiscovery,
    _Expired,
    load_api_client,
    ready_urls,
    slice_urls,
)
from pagedllm_testing.endpointslice_standin import build_slices
from pagedllm_testing.operator_harness import (
    SERVICE,
    EmulatorThread,
    Kube,
    endpoint,
    endpoint_slice,
    kubeconfig_text,
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


def test_follows_the_services_ready_endpoints(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    slices_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
        await asyncio.sleep(1.5)
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
    namespace: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A router whose API server cannot be reached keeps retrying instead of failing, and a
    router started before its Service has endpoints hears about them later."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "config"
    config.write_text(kubeconfig_text(f"http://127.0.0.1:{port}"))
    discovery = discovery_from_kubeconfig(
        config, monkeypatch, namespace, watch_timeout_seconds=1, max_backoff_seconds=0.5
    )
    path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"

    async def changes(seen: Seen) -> None:
        await asyncio.sleep(2)  # several refused attempts
        assert seen.calls == []
        with EmulatorThread(port=port) as late:
            kube = Kube(late.url)
            kube.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
            await seen.until([])
            kube.create(path, endpoint_slice("a", [endpoint("10.0.0.1")]))
            await seen.until(["http://10.0.0.1:8000"])

    run_with_discovery(discovery, changes)


def test_an_expired_watch_means_listing_again(
    emulator: EmulatorThread,
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    slices_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    discovery = discovery_from_kubeconfig(kubeconfig, monkeypatch, namespace)
    kube.create(slices_path, endpoint_slice("a", [endpoint("10.0.0.1")]))
    for index in range(3):
        kube.create(
            "/api/v1/namespaces/default/configmaps", {"metadata": {"name": f"{namespace}-{index}"}}
        )
    # The API server's history no longer reaches back to resourceVersion 1.
    del emulator.emulator.event_log[:-1]
    with pytest.raises(_Expired):
        discovery._watch({}, "1", lambda urls: None, threading.Event())


def test_endpointslice_standin_publishes_what_discovery_reads() -> None:
    """The e2e cluster's EndpointSlice controller stand-in: one slice per pod (their loopback
    ports differ), ready only while Ready and not terminating."""
    service = {
        "metadata": {"name": SERVICE, "namespace": "ns", "uid": "svc-uid"},
        "spec": {
            "selector": {"app": "x"},
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        },
    }

    def pod(name: str, port: int, ready: bool, deleting: bool = False) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": "ns",
            "uid": f"{name}-uid-0000",
            "labels": {"app": "x"},
            "annotations": {"e2e.pagedllm.io/host-ports": f'{{"8000": {port}}}'},
        }
        if deleting:
            metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return {
            "metadata": metadata,
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    slices = build_slices(
        service,
        [
            pod("p1", 4001, True),
            pod("p2", 4002, False),
            pod("p3", 4003, True, deleting=True),
            {**pod("p4", 4004, True), "metadata": {"name": "p4", "labels": {"app": "y"}}},
        ],
    )
    assert len(slices) == 3
    assert all(s["metadata"]["labels"][SERVICE_NAME_LABEL] == SERVICE for s in slices)
    assert ready_urls(slices, "http") == ["http://127.0.0.1:4001"]
    terminating = next(s for s in slices if s["endpoints"][0]["targetRef"]["name"] == "p3")
    assert terminating["endpoints"][0]["conditions"] == {
        "ready": False,
        "serving": True,
        "terminating": True,
    }
