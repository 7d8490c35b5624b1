"""A stand-in for a custom-metrics adapter (test infrastructure: prometheus-adapter answers from
a Prometheus, which the tests do not run): an HTTPS server of the custom.metrics.k8s.io/v1beta2
API, registered with the real apiserver as an APIService, that the real HPA controller reads
through the aggregation layer. It runs as a pod of the test cluster with a ServiceAccount that
may list pods.

It serves prometheus-adapter's rule from docs/kubernetes/scaling.md: the metric
`vllm_NAME` of a pod is the sum of the samples of the series `vllm:NAME` on the pod's
/metrics (port `prometheus.io/port`), read when asked. Not emulated: checking the aggregator's
front-proxy client certificate (it trusts whoever reaches it), metric label selectors, metrics
of objects other than pods.

`python -P -m pagedllm_testing.custom_metrics_adapter --port 6443`
"""

from __future__ import annotations

import argparse
import datetime
import json
import ssl
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pagedllm.operator.autoscaler import parse_prometheus_value
from pagedllm.operator.spec import Metric
from pagedllm_testing.cluster import pki

GROUP_VERSION = "custom.metrics.k8s.io/v1beta2"
PREFIX = f"/apis/{GROUP_VERSION}"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
APISERVER = "https://kubernetes.default.svc"
METRICS = tuple(m.custom_metric_name for m in Metric)


def resource_list() -> dict[str, Any]:
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": [
            {
                "name": f"pods/{name}",
                "singularName": "",
                "namespaced": True,
                "kind": "MetricValueList",
                "verbs": ["get"],
            }
            for name in METRICS
        ],
    }


def group_list() -> dict[str, Any]:
    version = {"groupVersion": GROUP_VERSION, "version": GROUP_VERSION.split("/")[1]}
    group = {
        "name": GROUP_VERSION.split("/")[0],
        "versions": [version],
        "preferredVersion": version,
    }
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group]}


def series_of(metric: str) -> str | None:
    """prometheus-adapter's `vllm:(.*)` -> `vllm_${1}`, backwards."""
    return f"vllm:{metric.removeprefix('vllm_')}" if metric.startswith("vllm_") else None


def quantity(value: float) -> str:
    return f"{round(value * 1000)}m"


def metric_value(pod: Mapping[str, Any], metric: str, value: float) -> dict[str, Any]:
    meta = pod["metadata"]
    return {
        "describedObject": {
            "kind": "Pod",
            "namespace": meta["namespace"],
            "name": meta["name"],
            "apiVersion": "/v1",
        },
        "metric": {"name": metric, "selector": None},
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "value": quantity(value),
    }


class Cluster:
    """The adapter's view of the cluster: pods, through the apiserver, as its ServiceAccount."""

    def __init__(self) -> None:
        self.context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))

    def pods(self, namespace: str, selector: str | None, name: str) -> list[dict[str, Any]]:
        query = {"labelSelector": selector} if selector else {}
        if name != "*":
            query["fieldSelector"] = f"metadata.name={name}"
        path = f"/api/v1/namespaces/{namespace}/pods?{urllib.parse.urlencode(query)}"
        token = (SERVICE_ACCOUNT / "token").read_text()
        request = urllib.request.Request(
            APISERVER + path,
            headers={"Authorization": f"Bearer {token}", "User-Agent": "custom-metrics-standin"},
        )
        with urllib.request.urlopen(request, context=self.context, timeout=10) as answer:
            return list(json.load(answer)["items"])


def scrape(pod: Mapping[str, Any], series: str) -> float | None:
    """The series' value on a running pod's /metrics, None when it has none."""
    address = (pod.get("status") or {}).get("podIP")
    port = (pod["metadata"].get("annotations") or {}).get("prometheus.io/port")
    if not address or not port or (pod.get("status") or {}).get("phase") != "Running":
        return None
    try:
        with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=2) as answer:
            text = answer.read().decode()
        return parse_prometheus_value(text, series)
    except (OSError, ValueError):  # gone, or not serving metrics yet
        return None


class Handler(BaseHTTPRequestHandler):
    cluster: Cluster

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urllib.parse.urlsplit(self.path)
        if url.path in (PREFIX, PREFIX + "/"):
            return self._send(200, resource_list())
        if url.path in ("/apis", "/apis/"):  # the aggregator's discovery of what it serves
            return self._send(200, group_list())
        parts = [urllib.parse.unquote(p) for p in url.path.removeprefix(PREFIX + "/").split("/")]
        # namespaces/NS/pods/NAME-or-*/METRIC
        if len(parts) == 5 and parts[0] == "namespaces" and parts[2] == "pods":
            _, namespace, _, name, metric = parts
            series = series_of(metric)
            if series is None:
                return self._send(404, status(404, f"no metric {metric}"))
            selector = urllib.parse.parse_qs(url.query).get("labelSelector", [None])[0]
            try:
                pods = self.cluster.pods(namespace, selector, name)
            except OSError as error:
                return self._send(503, status(503, f"listing pods: {error}"))
            items = []
            for pod in pods:
                value = scrape(pod, series)
                if value is not None:
                    items.append(metric_value(pod, metric, value))
            body = {
                "kind": "MetricValueList",
                "apiVersion": GROUP_VERSION,
                "metadata": {},
                "items": items,
            }
            return self._send(200, body)
        if url.path in ("/healthz", "/readyz", "/livez"):
            return self._send(200, {"status": "ok"})
        return self._send(404, status(404, f"{url.path} not found"))

    def _send(self, code: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        print(f"{self.address_string()} {format % args}", flush=True)


def status(code: int, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "code": code,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -P -m pagedllm_testing.custom_metrics_adapter")
    parser.add_argument("--port", type=int, default=6443)
    args = parser.parse_args(argv)
    # A serving certificate of its own: the APIService skips verifying it, as the adapters'
    # sample manifests do.
    directory = Path(tempfile.mkdtemp(prefix="custom-metrics-"))
    ca = pki.make_ca(directory, "ca", "custom-metrics-standin-ca")
    serving = pki.issue(
        ca,
        directory,
        "serving",
        "custom-metrics-standin",
        server_names=("localhost",),
        client=False,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(serving.cert), str(serving.key))
    Handler.cluster = Cluster()
    server = ThreadingHTTPServer(("", args.port), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    print(f"serving {GROUP_VERSION} on port {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
