"""The built-in autoscaler end to end on the real kube-apiserver: pods' /metrics served by real
local HTTP endpoints (the pods' statuses written by the test, as envtest's tests do)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from pagedllm_testing.operator_harness import OPERATOR_ENV, PLLM, Kube, eventually, pagedllm

pytestmark = pytest.mark.usefixtures("crd", "operator_process")

RESYNC_SECONDS = float(OPERATOR_ENV["PAGEDLLM_OPERATOR_RESYNC_SECONDS"])


class MetricsEndpoint:
    """One pod's /metrics, with the vLLM series the node exports."""

    def __init__(self) -> None:
        self.running = 0.0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                body = (
                    "# HELP vllm:num_requests_running Requests being processed.\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{model_name="demo"}} {endpoint.running}\n'
                    f'vllm:num_requests_waiting{{model_name="demo"}} 0.0\n'
                    f'vllm:kv_cache_usage_perc{{model_name="demo"}} 0.1\n'
                ).encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoints() -> Iterator[list[MetricsEndpoint]]:
    started = [MetricsEndpoint() for _ in range(3)]
    yield started
    for endpoint in started:
        endpoint.close()


def add_ready_pod(
    kube: Kube, namespace: str, name: str, owner: str, endpoint: MetricsEndpoint
) -> None:
    """A pod as the e2e kubelet stand-in reports it: a local process on a loopback port."""
    pods = f"/api/v1/namespaces/{namespace}/pods"
    kube.create(
        pods,
        {
            "metadata": {
                "name": name,
                "labels": {"app.kubernetes.io/name": "pagedllm", "pagedllm.io/instance": owner},
                "annotations": {"pagedllm.io/metrics-port": str(endpoint.port)},
            },
            "spec": {
                "containers": [
                    {
                        "name": "pagedllm",
                        "image": "pagedllm",
                        "ports": [{"name": "http", "containerPort": 8000}],
                    }
                ]
            },
        },
    )
    kube.merge(
        f"{pods}/{name}/status",
        {
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        },
    )


SCALE_DOWN_DELAY = 4.0


def test_scales_up_at_once_within_bounds_and_down_after_the_delay(
    kube: Kube, namespace: str, endpoints: list[MetricsEndpoint]
) -> None:
    """10 requests in flight scale up to maxReplicas at once; when the load goes, /scale goes
    to zero only once scaleDownDelaySeconds of lower load have been observed."""
    path = f"{PLLM}/namespaces/{namespace}/pagedllms/demo"
    deployment = f"/apis/apps/v1/namespaces/{namespace}/deployments/demo"
    kube.create(
        f"{PLLM}/namespaces/{namespace}/pagedllms",
        pagedllm(
            "demo",
            {
                "model": {"servedName": "demo"},
                "autoscaling": {
                    "minReplicas": 0,
                    "maxReplicas": 3,
                    "metric": "inflightRequests",
                    "target": 2,
                    "scaleDownDelaySeconds": int(SCALE_DOWN_DELAY),
                },
            },
        ),
    )
    eventually(lambda: kube.get(deployment), what="the Deployment")
    assert kube.get(deployment)["spec"]["replicas"] == 1

    # 10 requests in flight on the one pod: ceil(10 / 2) = 5, capped at maxReplicas.
    endpoints[0].running = 10
    add_ready_pod(kube, namespace, "demo-0", "demo", endpoints[0])
    eventually(lambda: kube.get(path)["spec"].get("replicas") == 3, what="scale up to 3")
    eventually(
        lambda: kube.get(deployment)["spec"]["replicas"] == 3,
        what="the Deployment to follow /scale",
    )
    status = eventually(lambda: (s := kube.get(path)["status"]).get("lastScaleTime") and s)
    assert status["desiredReplicas"] == 3
    events = kube.list(f"/api/v1/namespaces/{namespace}/events")
    scaled_up = [e for e in events if e["reason"] == "ScaledUp"]
    assert scaled_up and "1 -> 3 replicas" in scaled_up[0]["message"]

    # The load goes away: nothing moves before scaleDownDelaySeconds of lower load.
    add_ready_pod(kube, namespace, "demo-1", "demo", endpoints[1])
    add_ready_pod(kube, namespace, "demo-2", "demo", endpoints[2])
    endpoints[0].running = 0
    idle_since = time.monotonic()
    eventually(
        lambda: kube.get(path)["spec"]["replicas"] == 0,
        timeout=10,
        what="scale to zero after the delay",
    )
    # The window of lower load begins after the last sample of the high load, which a resync
    # took up to a resync period (and that resync's own duration) before the load went.
    assert time.monotonic() - idle_since >= SCALE_DOWN_DELAY - 2 * RESYNC_SECONDS
    eventually(lambda: kube.get(deployment)["spec"]["replicas"] == 0)
    ready = eventually(
        lambda: next(
            (
                c
                for c in kube.get(path)["status"]["conditions"]
                if c["type"] == "Ready" and c["reason"] == "ScaledToZero"
            ),
            None,
        ),
        what="Ready=False/ScaledToZero",
    )
    assert ready["status"] == "False"
    assert any(
        e["reason"] == "ScaledDown" for e in kube.list(f"/api/v1/namespaces/{namespace}/events")
    )
