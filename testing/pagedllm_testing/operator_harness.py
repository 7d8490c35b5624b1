"""Helpers of the operator suite: a small REST client for the API emulator, polling, and the
real operator (`kopf run -m pagedllm.operator`) as a child process with fast timers."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from pagedllm.operator.children import (
    Owner,
)
from pagedllm.router.discovery import (
    SERVICE_NAME_LABEL,
)

# Re-exported for the fixtures (explicit `as` marks the re-export).
from pagedllm_testing.cluster import binary
from pagedllm_testing.emulator import EmulatorThread as EmulatorThread
from pagedllm_testing.emulator import kubeconfig_text as kubeconfig_text
from pagedllm_testing.polling import eventually as _eventually

REPO = Path(__file__).resolve().parents[2]

CRD_PATH = REPO / "crds" / "pagedllm.yaml"
SAMPLES = REPO / "manifests" / "samples"
PLLM = "/apis/pagedllm.io/v1alpha1"

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
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stderr}")
        return result

    return run


class Kube:
    """Plain REST calls to the emulator, as any client would make them."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, timeout=10)

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
            raise KubeError(response.status_code, response.json())
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


# The operator suite polls the in-process emulator more often than the e2e scenario does.
eventually = functools.partial(_eventually, interval=0.1)


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
