"""Helpers of the operator suite: a small REST client for the test cluster's kube-apiserver
(pagedllm_testing.cluster), its audit log read as it grows, polling, a TCP forwarder that stands
between a client and the apiserver, and the real operator (`kopf run -m pagedllm.operator`) as a
child process with fast timers."""

from __future__ import annotations

import base64
import functools
import json
import os
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from pagedllm.operator.children import (
    Owner,
)
from pagedllm.operator.kube import now_rfc3339
from pagedllm.router.discovery import (
    SERVICE_NAME_LABEL,
)
from pagedllm_testing.cluster import binary
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.polling import eventually as _eventually

REPO = Path(__file__).resolve().parents[2]

CRD_PATH = REPO / "crds" / "pagedllm.yaml"
SAMPLES = REPO / "manifests" / "samples"
PLLM = "/apis/pagedllm.io/v1alpha1"
# spec.router as the CRD's defaults fill it in.
ROUTER_DEFAULTS = {
    "enabled": True,
    "replicas": 2,
    "policy": "prefix",
    "loadBound": 1.25,
    "maxHeldRequests": 64,
    "holdTimeoutSeconds": 600,
}

# Fast loops: the suite waits on the operator, so its timers set the pace.
OPERATOR_ENV = {
    "PAGEDLLM_OPERATOR_RESYNC_SECONDS": "0.5",
    "PAGEDLLM_OPERATOR_WATCH_TIMEOUT_SECONDS": "5",
    "PAGEDLLM_OPERATOR_BACKOFF_SECONDS": "0.5",
    "PAGEDLLM_OPERATOR_BACKOFF_MAX_SECONDS": "2",
    "PAGEDLLM_OPERATOR_METRICS_TIMEOUT_SECONDS": "1",
    "PAGEDLLM_OPERATOR_DISCOVERY_CACHE_SECONDS": "0.5",
}


Kubectl = Callable[..., subprocess.CompletedProcess[str]]


def kubectl_for(kubeconfig: Path, namespace: str) -> Kubectl:
    """The built kubectl, against the cluster of `kubeconfig`, in `namespace`; a failing
    command fails the test unless called with check=False."""
    kubectl = binary.kubectl()

    def run(
        *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [kubectl, "--namespace", namespace, *args],
            input=stdin,
            text=True,
            capture_output=True,
            timeout=60,
            # A discovery cache of this cluster's own (kubectl keys it by the server's address).
            env={
                **os.environ,
                "KUBECONFIG": str(kubeconfig),
                "KUBECACHEDIR": str(kubeconfig.parent / "kubectl-cache"),
            },
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stderr}")
        return result

    return run


class Kube:
    """Plain REST calls to an API server, as any client would make them (User-Agent
    python-httpx, which tells the test's requests from the operator's in the audit log)."""

    def __init__(self, url: str, verify: ssl.SSLContext | bool = True):
        self.http = httpx.Client(base_url=url, verify=verify, timeout=10, trust_env=False)

    @classmethod
    def admin(cls, cluster: ControlPlane) -> Kube:
        """The cluster's admin (system:masters) by client certificate, the cluster CA trusted."""
        return cls(cluster.server, verify=cluster.ssl_context(cluster.admin))

    def close(self) -> None:
        self.http.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        **params: str,
    ) -> Any:
        response = self.http.request(
            method,
            path,
            params=params or None,
            content=None if body is None else json.dumps(body),
            headers={"Content-Type": content_type},
        )
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:  # e.g. "404 page not found" for a group that is not served
                body = {"message": response.text}
            raise KubeError(response.status_code, body)
        return response.json()

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    def list(self, path: str, **params: str) -> list[dict[str, Any]]:
        return self.request("GET", path, **params)["items"]

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body)

    def merge(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, patch, "application/merge-patch+json")

    def delete(self, path: str) -> dict[str, Any]:
        return self.request("DELETE", path)


class KubeError(Exception):
    def __init__(self, status: int, body: dict[str, Any]):
        super().__init__(f"{status}: {body.get('message')}")
        self.status = status
        self.body = body


# The operator suite polls a local apiserver more often than the e2e scenario does.
eventually = functools.partial(_eventually, interval=0.1)


class AuditLog:
    """A cluster's audit log (one audit.k8s.io/v1 Event a line), from where it ended when
    the reader was made: each `read()` parses only what was written since the last."""

    def __init__(self, cluster: ControlPlane):
        self.path = cluster.layout.audit_log
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.events: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        """Every event since the reader was made, in the order the apiserver wrote them (as
        requests finished)."""
        with self.path.open("rb") as log:
            log.seek(self.offset)
            data = log.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        self.events += [json.loads(line) for line in data[:end].splitlines() if line]
        return self.events


def token_id(token: str) -> str:
    """The credential id the apiserver's audit log names a service-account token by: JTI=
    and the token's jti claim."""
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return f"JTI={claims['jti']}"


class TcpProxy:
    """A TCP forwarder from a loopback port to `target` (host, port), in threads of its own.
    TLS passes through untouched: a client verifies the apiserver's certificate (which names
    127.0.0.1) and presents its own as if it were connected directly.
    `delay` holds every piece of the server's answers back that many seconds."""

    def __init__(self, target: tuple[str, int], port: int = 0):
        self.target = target
        self.delay = 0.0
        self._sockets: list[socket.socket] = []
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._forward(self.request)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self.server = Server(("127.0.0.1", port), Handler)
        self.port: int = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _forward(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            return
        upstream.settimeout(None)
        self._sockets += [client, upstream]

        def pump(source: socket.socket, sink: socket.socket, delayed: bool) -> None:
            try:
                while data := source.recv(65536):
                    if delayed and self.delay:
                        time.sleep(self.delay)
                    sink.sendall(data)
            except OSError:
                pass
            finally:
                for end in (source, sink):
                    try:
                        end.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        back = threading.Thread(target=pump, args=(upstream, client, True), daemon=True)
        back.start()
        pump(client, upstream, False)
        back.join()
        upstream.close()

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        for connection in self._sockets:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=10)


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def pagedllm(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "pagedllm.io/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": name},
        "spec": spec,
    }


class OperatorProcess:
    """The operator as users run it, in a child process, logging to a file."""

    def __init__(
        self,
        kubeconfig: Path,
        workdir: Path,
        command: list[str],
        env: dict[str, str] | None = None,
    ):
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.command = command
        self.env = env or {}  # over OPERATOR_ENV
        self.log_path = workdir / "operator.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, **OPERATOR_ENV, **self.env, "KUBECONFIG": str(self.kubeconfig)}
        log = self.log_path.open("ab")
        # The working directory is not the repository root: there, the folder operator/
        # would shadow the standard library's `operator` module.
        self.process = subprocess.Popen(
            self.command, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        eventually(
            lambda: "Initial authentication has finished" in self.log(),
            timeout=30,
            what="the operator to start",
        )

    def stop(self) -> int:
        assert self.process is not None
        self.process.terminate()
        code = self.process.wait(timeout=20)
        self.process = None
        return code

    def cpu_seconds(self) -> float:
        """User and system CPU time the process has used (its threads' included)."""
        assert self.process is not None
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        # utime and stime are fields 14 and 15 of stat(5); the split starts at field 3.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


KOPF_RUN = [sys.executable, "-m", "kopf", "run", "-m", "pagedllm.operator", "--all-namespaces"]


OWNER = Owner(name="llama", namespace="models", uid="0b3a2c1e-0000-4000-8000-000000000001")


SPECS: dict[str, dict[str, Any]] = {
    "demo": {"model": {"servedName": "demo"}},
    "image-path": {
        "model": {"uri": "/opt/models/tiny", "servedName": "tiny"},
        "replicas": 3,
        "rollout": {"strategy": "Recreate"},
        "env": [{"name": "A", "value": "1"}],
    },
    "pvc": {
        "model": {"uri": "pvc://weights/llama/8b", "servedName": "llama"},
        "apiKeySecretRef": {"name": "key"},
        "scheduling": {
            "nodeSelector": {"gpu": "l4"},
            "priorityClassName": "serving",
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["a"]}
                                ]
                            }
                        ]
                    }
                }
            },
        },
    },
    "hf-gpu-hpa": {
        "model": {"uri": "hf://meta-llama/Llama-3.1-8B", "servedName": "llama"},
        "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "48Gi"}},
        "engine": {
            "tensorParallelSize": 2,
            "kvCacheMemory": "8Gi",
            "enablePrefixCaching": False,
            "extraArgs": ["--seed", "1"],
        },
        "autoscaling": {
            "minReplicas": 2,
            "maxReplicas": 6,
            "target": 0.75,
            "metric": "kvCacheUsage",
            "mode": "hpa",
        },
    },
}


def pllm_path(namespace: str, name: str = "", sub: str = "") -> str:
    path = f"{PLLM}/namespaces/{namespace}/pagedllms"
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def deployment_path(namespace: str, name: str = "") -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments" + (f"/{name}" if name else "")


def service_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/services/{name}"


def pdb_path(namespace: str, name: str) -> str:
    return f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}"


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for item in ((obj or {}).get("status") or {}).get("conditions") or []:
        if item["type"] == kind:
            return item
    return {}


def wait_for_condition(
    kube: Kube, namespace: str, name: str, kind: str, what: str, **fields: str
) -> dict[str, Any]:
    """The resource's ``kind`` condition once it has ``fields`` (``status="True"``, say)."""

    def matching() -> dict[str, Any] | None:
        found = condition(kube.get(pllm_path(namespace, name)), kind)
        return found if all(found.get(k) == v for k, v in fields.items()) else None

    return eventually(matching, what=what)


def mark_deployment_ready(kube: Kube, namespace: str, name: str, ready: int) -> None:
    """What the Deployment controller reports once `ready` pods pass their readiness probe."""
    live = kube.get(deployment_path(namespace, name))
    replicas = live["spec"]["replicas"]
    kube.merge(
        deployment_path(namespace, name) + "/status",
        {
            "status": {
                "observedGeneration": live["metadata"]["generation"],
                "replicas": replicas,
                "updatedReplicas": replicas,
                "readyReplicas": ready,
                "availableReplicas": ready,
            }
        },
    )


def host_address(cluster: ControlPlane) -> str:
    """This machine's address on the cluster's bridge: an address an EndpointSlice may name
    (the apiserver refuses loopback ones) at which a local process listening on every
    interface is reached."""
    return cluster.current.advertise_address


def pods_path(namespace: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")


def create_node(kube: Kube, name: str) -> dict[str, Any]:
    """A Node as a kubelet registers it, before its first status: the apiserver taints it
    not-ready (NoSchedule), so the scheduler places nothing there, and the node lifecycle
    controller leaves it and its pods alone for its startup grace period (60 s)."""
    return kube.create("/api/v1/nodes", {"metadata": {"name": name}})


def bind(kube: Kube, namespace: str, pod: str, node: str) -> None:
    """The scheduler's write: `pod` bound to `node` through the binding subresource."""
    kube.create(
        pods_path(namespace, pod) + "/binding",
        {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": pod},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        },
    )


def report_running(kube: Kube, namespace: str, pod: str, ip: str, ready: bool = True) -> None:
    """What the kubelet reports once the pod's containers run and (if `ready`) pass their
    readiness probes."""
    containers = kube.get(pods_path(namespace, pod))["spec"]["containers"]
    flag = "True" if ready else "False"
    kube.merge(
        pods_path(namespace, pod) + "/status",
        {
            "status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Initialized", "status": "True"},
                    {"type": "ContainersReady", "status": flag},
                    {"type": "Ready", "status": flag},
                ],
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c["image"],
                        "imageID": "",
                        "ready": ready,
                        "restartCount": 0,
                        "started": True,
                        "state": {"running": {"startedAt": now_rfc3339()}},
                    }
                    for c in containers
                ],
            }
        },
    )


def confirm_terminated(kube: Kube, namespace: str) -> int:
    """The kubelet's last word on pods being deleted gracefully from a node: their containers
    are gone, so it deletes them for good (grace period 0). How many pods are left."""
    pods = kube.list(pods_path(namespace))
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            try:
                path = pods_path(namespace, pod["metadata"]["name"])
                kube.request("DELETE", path, {"gracePeriodSeconds": 0})
            except KubeError as error:
                if error.status != 404:
                    raise
    return len(pods)


SERVICE = "demo-serving"


def endpoint(address: str, ready: bool | None = True, terminating: bool = False) -> dict:
    conditions: dict[str, Any] = {"terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    return {"addresses": [address], "conditions": conditions}


def endpoint_slice(
    name: str,
    endpoints: list[dict],
    port: int = 8000,
    port_name: str = "http",
    service: str = SERVICE,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {SERVICE_NAME_LABEL: service}},
        "addressType": address_type,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }
