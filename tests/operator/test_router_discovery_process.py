"""A real `pagedllm router` process finding its backends through Kubernetes discovery (the real
kube-apiserver's EndpointSlices, written by the test as the EndpointSlice controller would;
credentials from $KUBECONFIG, the admin's client certificate), and refusing flags that do not
go together."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm.config import resolve_model_dir
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.operator_harness import (
    PLLM,
    SERVICE,
    Kube,
    endpoint,
    endpoint_slice,
    eventually,
    host_address,
    pagedllm,
)
from pagedllm_testing.serve_harness import DEMO_MODEL, PAGEDLLM, Server, start_command, start_server


@pytest.fixture(scope="module")
def model_dir() -> str:
    return resolve_model_dir(None)


def backends_in_metrics(url: str) -> list[str]:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sorted(set(re.findall(r'router_backend_ready\{backend="([^"]+)"\}', text)))


def discovering_router(
    tmp_path: Path, model_dir: str, namespace: str, kubeconfig: Path, *args: str
) -> Server:
    """A router following `SERVICE`'s endpoints in ``namespace`` (credentials: $KUBECONFIG)."""
    return start_command(
        tmp_path,
        "router",
        "--model",
        model_dir,
        "--discover-namespace",
        namespace,
        "--discover-service",
        SERVICE,
        *args,
        env={"KUBECONFIG": str(kubeconfig), "KUBERNETES_SERVICE_HOST": ""},
    )


def test_router_follows_the_services_endpoints(
    cluster: ControlPlane,
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    model_dir: str,
    tmp_path: Path,
) -> None:
    """The router's backends follow the Service's ready endpoints (on ports where nothing
    listens: its own health never depends on them)."""
    host = host_address(cluster)
    path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
    kube.create(path, endpoint_slice("a", [endpoint(host)], port=1))
    router = discovering_router(tmp_path, model_dir, namespace, kubeconfig)
    try:
        eventually(
            lambda: backends_in_metrics(router.url) == [f"http://{host}:1"],
            timeout=30,
            what="the router to subscribe to the discovered backend",
        )
        kube.create(path, endpoint_slice("b", [endpoint(host)], port=2))
        kube.merge(f"{path}/a", {"endpoints": [endpoint(host, ready=False)]})
        eventually(
            lambda: backends_in_metrics(router.url) == [f"http://{host}:2"],
            timeout=30,
            what="the router to follow the change",
        )
        # Its own health never depended on the backends (none of which serves anything).
        assert router.health() == 200
    finally:
        router.stop()


def waking_router(
    tmp_path: Path, model_dir: str, namespace: str, kubeconfig: Path, *args: str
) -> Server:
    """Holding up to 4 requests, and waking the PagedLLM `demo`."""
    wake = ["--max-held-requests", "4", "--scale-from-zero", "demo", *args]
    return discovering_router(tmp_path / "router", model_dir, namespace, kubeconfig, *wake)


@pytest.mark.usefixtures("crd")
def test_a_router_holding_a_stream_scales_its_pagedllm_from_zero(
    cluster: ControlPlane,
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    model_dir: str,
    tmp_path: Path,
) -> None:
    """The PagedLLM is at zero and its Service has no endpoint: a streaming request is held,
    the router writes /scale (once), and when a node comes up late (as the operator and the
    kubelet would bring it) the held stream runs to its end."""
    created = kube.create(
        f"{PLLM}/namespaces/{namespace}/pagedllms",
        pagedllm("demo", {"model": {"servedName": DEMO_MODEL}, "replicas": 0}),
    )
    scale_path = f"{PLLM}/namespaces/{namespace}/pagedllms/demo"
    router = waking_router(
        tmp_path, model_dir, namespace, kubeconfig, "--scale-from-zero-replicas", "2"
    )
    node: Server | None = None
    pieces: list[str] = []
    failures: list[BaseException] = []
    first_token: list[float] = []

    def stream() -> None:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
        try:
            sent = time.monotonic()
            for chunk in client.completions.create(
                model=DEMO_MODEL, prompt="wake up", max_tokens=8, stream=True, timeout=300
            ):
                if not first_token:
                    first_token.append(time.monotonic() - sent)
                pieces.append(chunk.choices[0].text)
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    client_thread = threading.Thread(target=stream)
    try:
        client_thread.start()
        eventually(
            lambda: router.metric("pagedllm:router_held_requests") == 1,
            timeout=30,
            what="the stream to be held",
        )
        woken = eventually(
            lambda: (kube.get(scale_path) or {}).get("spec", {}).get("replicas") or None,
            timeout=30,
            what="the router to write /scale",
        )
        assert woken == 2
        version = kube.get(scale_path)["metadata"]["resourceVersion"]
        assert version != created["metadata"]["resourceVersion"]
        # On every interface: the router reaches it at this machine's bridge address.
        node = start_server(tmp_path / "late-node", "--host", "0.0.0.0")
        kube.create(
            f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
            endpoint_slice("late", [endpoint(host_address(cluster))], port=node.port),
        )
        client_thread.join(timeout=180)
        assert not client_thread.is_alive() and not failures, failures
        assert first_token and len(pieces) >= 1 and "".join(pieces)
        assert router.metric("pagedllm:router_held_requests") == 0
        # Nothing more was written: the PagedLLM is not at zero any more.
        assert kube.get(scale_path)["metadata"]["resourceVersion"] == version
    finally:
        client_thread.join(timeout=5)
        router.stop()
        if node is not None:
            node.stop()


@pytest.mark.usefixtures("crd")
def test_a_router_leaves_a_pagedllm_that_is_not_at_zero_alone(
    kube: Kube, kubeconfig: Path, namespace: str, model_dir: str, tmp_path: Path
) -> None:
    """Pods are starting (replicas 1, none ready): a held request writes nothing, and past
    --hold-timeout it gets a 503 with Retry-After."""
    created = kube.create(
        f"{PLLM}/namespaces/{namespace}/pagedllms",
        pagedllm("demo", {"model": {"servedName": DEMO_MODEL}, "replicas": 1}),
    )
    router = waking_router(tmp_path, model_dir, namespace, kubeconfig, "--hold-timeout", "3")
    try:
        answer = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": DEMO_MODEL, "prompt": "x", "max_tokens": 2},
            timeout=60,
        )
        assert answer.status_code == 503 and answer.headers["retry-after"]
        assert answer.json()["error"]["code"] == "hold_timeout"
        body = kube.get(f"{PLLM}/namespaces/{namespace}/pagedllms/demo")
        assert body["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
        assert body["spec"]["replicas"] == 1
    finally:
        router.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--discover-namespace", "ns"], "--discover-namespace and --discover-service go together"),
        (
            ["--discover-namespace", "ns", "--discover-service", "s", "--backends", "http://a:1"],
            "exclude each other",
        ),
        ([], "--backends is required (the serving nodes to route to), or --discover-namespace"),
        (
            ["--discover-namespace", "Bad_NS", "--discover-service", "s"],
            "expected a Kubernetes name",
        ),
        (
            ["--backends", "http://a:1", "--max-held-requests", "1", "--scale-from-zero", "x"],
            "--scale-from-zero needs --discover-namespace",
        ),
        (
            ["--discover-namespace", "ns", "--discover-service", "s", "--scale-from-zero", "x"],
            "--scale-from-zero needs --max-held-requests above 0",
        ),
    ],
)
def test_discovery_flags_are_checked(args: list[str], message: str, model_dir: str) -> None:
    result = subprocess.run(
        [PAGEDLLM, "router", "--model", model_dir, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_no_credentials_stops_the_router_with_a_message(model_dir: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [PAGEDLLM, "router", "--model", model_dir]
        + ["--discover-namespace", "ns", "--discover-service", "s"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "x")},
    )
    assert result.returncode == 1
    assert "no Kubernetes credentials" in result.stderr
