"""A real `pagedllm router` process finding its backends through Kubernetes discovery (the
API emulator's EndpointSlices, credentials from $KUBECONFIG), and refusing flags that do not
go together."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest

from pagedllm.config import resolve_model_dir
from tests.operator.operator_harness import Kube, eventually
from tests.operator.test_router_discovery import SERVICE, endpoint, endpoint_slice
from tests.serve.serve_harness import PAGEDLLM, start_command


@pytest.fixture(scope="module")
def model_dir() -> str:
    return resolve_model_dir(None)


def backends_in_metrics(url: str) -> list[str]:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sorted(set(re.findall(r'router_backend_ready\{backend="([^"]+)"\}', text)))


def test_router_follows_the_services_endpoints(
    kube: Kube, kubeconfig: Path, namespace: str, model_dir: str, tmp_path: Path
) -> None:
    path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
    kube.create(path, endpoint_slice("a", [endpoint("127.0.0.1")], port=1))
    router = start_command(
        tmp_path,
        "router",
        "--model",
        model_dir,
        "--discover-namespace",
        namespace,
        "--discover-service",
        SERVICE,
        env={"KUBECONFIG": str(kubeconfig), "KUBERNETES_SERVICE_HOST": ""},
    )
    try:
        eventually(
            lambda: backends_in_metrics(router.url) == ["http://127.0.0.1:1"],
            timeout=30,
            what="the router to subscribe to the discovered backend",
        )
        kube.create(path, endpoint_slice("b", [endpoint("127.0.0.2")], port=2))
        kube.merge(f"{path}/a", {"endpoints": [endpoint("127.0.0.1", ready=False)]})
        eventually(
            lambda: backends_in_metrics(router.url) == ["http://127.0.0.2:2"],
            timeout=30,
            what="the router to follow the change",
        )
        # Its own health never depended on the backends (none of which serves anything).
        assert router.health() == 200
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
