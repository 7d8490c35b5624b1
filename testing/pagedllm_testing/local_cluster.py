"""The scenario's cluster on one machine, without Docker: the real control plane
(cluster/control_plane.py: etcd, kube-apiserver, kube-controller-manager with the Deployment,
ReplicaSet, EndpointSlice, disruption, garbage-collector and HPA controllers, kube-scheduler),
a process kubelet per node (cluster/kubelet/) over a system node and a few GPU nodes
(ClusterShape), the operator as a pod of `kubectl apply -k manifests/` with its own
ServiceAccount, and, in a thread, the tests' stand-ins for what these machines cannot run:
kube-proxy (service_proxy.py: a loopback listener per Service port over its EndpointSlices)
and, once the scenario starts it, the cluster autoscaler (cluster_autoscaler_standin.py).

`stop` ends it all; `live_processes` tells whether anything it started is still alive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagedllm_testing.cluster import network
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.cluster.image import BIN_DIR, image_env
from pagedllm_testing.cluster.kubelet import pod_network
from pagedllm_testing.cluster.kubelet.node import (
    GPU_GROUP,
    NODE_GROUP_LABEL,
    NodeSpec,
    cluster_nodes,
    now,
)
from pagedllm_testing.cluster.kubelet.pods import process_group_members
from pagedllm_testing.cluster_autoscaler_standin import (
    ClusterAutoscalerStandin,
    NodeGroup,
    Timers,
    is_terminating,
)
from pagedllm_testing.polling import eventually
from pagedllm_testing.service_proxy import PortProxy, ServiceProxies

REPO = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "pagedllm-system"
OPERATOR = "pagedllm-operator"
# The operator's timers, short: the scenario waits on them (set on its Deployment with
# `kubectl set env`, as a user tunes it).
FAST_OPERATOR_ENV = {
    "PAGEDLLM_OPERATOR_RESYNC_SECONDS": "1",
    "PAGEDLLM_OPERATOR_WATCH_TIMEOUT_SECONDS": "60",
    "PAGEDLLM_OPERATOR_BACKOFF_SECONDS": "1",
    "PAGEDLLM_OPERATOR_BACKOFF_MAX_SECONDS": "5",
    "PAGEDLLM_OPERATOR_METRICS_TIMEOUT_SECONDS": "1",
}
STANDIN_INTERVAL = 0.25
# Where the scenario's PagedLLM lives.
NAMESPACE = "default"


@dataclass(frozen=True)
class ClusterShape:
    """The GPU nodes the cluster starts with: enough for the scenario's first steps (three
    replicas, a rolling update's surge pod, and old pods still draining, which hold their
    GPUs until they are gone), one GPU each."""

    gpu_nodes: int = 6
    gpus_per_node: int = 1


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    """Ready and not terminating (what the EndpointSlice controller counts as ready)."""
    if is_terminating(pod):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def local_url(pod: Mapping[str, Any], port: int = 8000) -> str:
    """A pod's port at its address on the cluster's bridge."""
    return f"http://{pod['status']['podIP']}:{port}"


def _tail(path: Path, lines: int) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Standins:
    """The tests' kube-proxy and cluster autoscaler stand-ins, on an event loop in a thread."""

    def __init__(self, control_plane: ControlPlane, namespace: str):
        self.control_plane = control_plane
        self.namespace = namespace
        self.log_path = control_plane.layout.logs / "standins.log"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="standins", daemon=True)
        self.proxies: ServiceProxies | None = None
        self.http: httpx.AsyncClient | None = None
        # Switched on by the scenario (start_cluster_autoscaler), then ticked with the others.
        self.autoscaler: ClusterAutoscalerStandin | None = None
        self._stop = threading.Event()
        self._done: concurrent.futures.Future[None] | None = None

    def start(self) -> None:
        self.thread.start()
        self._done = asyncio.run_coroutine_threadsafe(self._run(), self.loop)

    async def _run(self) -> None:
        self.http = httpx.AsyncClient(
            **self.control_plane.admin_client_options(),
            headers={"User-Agent": "pagedllm-e2e-standins"},
        )
        self.proxies = ServiceProxies(self.http, self.namespace)
        try:
            while not self._stop.is_set():
                for sync in (self.proxies.sync, self._autoscale):
                    try:
                        await sync()
                    except Exception:
                        with self.log_path.open("a") as log:
                            log.write(f"{now()} {traceback.format_exc()}\n")
                await asyncio.sleep(STANDIN_INTERVAL)
        finally:
            await self.proxies.close()
            await self.http.aclose()

    async def _autoscale(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.tick()

    def start_cluster_autoscaler(
        self, group: NodeGroup, timers: Timers, env: Mapping[str, str]
    ) -> ClusterAutoscalerStandin:
        assert self.http is not None, "the stand-ins are not running"
        self.autoscaler = ClusterAutoscalerStandin(
            self.http, NodeHost(self.control_plane, env), group, timers
        )
        return self.autoscaler

    def stop(self) -> None:
        self._stop.set()
        if self._done is not None:
            try:
                self._done.result(timeout=30)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout=10)


@dataclass
class NodeHost:
    """The cluster autoscaler stand-in's cloud: a node is a process kubelet of the cluster."""

    control_plane: ControlPlane
    env: Mapping[str, str]

    def add_node(self, node: NodeSpec) -> None:
        """Returns once the node is Ready: the stand-in counts nodes from the API, so one it
        has started must be there before it judges again (the real autoscaler counts its
        upcoming nodes instead)."""
        self.control_plane.add_node(node, image_env=self.env, bin_dirs=[str(BIN_DIR)])
        self.control_plane.wait_nodes_ready()

    def remove_node(self, name: str) -> None:
        self.control_plane.remove_node(name)


class LocalCluster:
    def __init__(self, workdir: Path, shape: ClusterShape | None = None):
        self.workdir = workdir
        self.shape = shape or ClusterShape()
        self.control_plane = ControlPlane(workdir / "cluster")
        self.kubeconfig = self.control_plane.layout.kubeconfig
        self.standins: Standins | None = None
        self.env: dict[str, str] = {}
        self._http: httpx.Client | None = None
        # What `stop` ended, for `live_processes` to check afterwards.
        self._stopped_pids: dict[str, int] = {}
        self._bridge: int | None = None

    @property
    def server(self) -> str:
        return self.control_plane.server

    # --- starting -------------------------------------------------------------------------

    def start(self) -> None:
        """The control plane, the nodes (each Ready), and the stand-ins."""
        self.env = image_env()
        self.control_plane.up()
        for node in cluster_nodes(self.shape.gpu_nodes, self.shape.gpus_per_node):
            self.control_plane.add_node(node, image_env=self.env, bin_dirs=[str(BIN_DIR)])
        self.control_plane.wait_nodes_ready(timeout=60)
        self.standins = Standins(self.control_plane, NAMESPACE)
        self.standins.start()

    def start_operator(self) -> None:
        """The operator's Deployment from manifests/ (applied before), with short timers set
        on it, rolled out and ready."""
        self.kubectl(
            "set",
            "env",
            f"deployment/{OPERATOR}",
            "-n",
            OPERATOR_NAMESPACE,
            *(f"{key}={value}" for key, value in FAST_OPERATOR_ENV.items()),
        )
        self.kubectl(
            "rollout",
            "status",
            f"deployment/{OPERATOR}",
            "-n",
            OPERATOR_NAMESPACE,
            "--timeout=120s",
            timeout=140,
        )

    # --- using -----------------------------------------------------------------------------

    def http(self) -> httpx.Client:
        """An admin client of the apiserver."""
        if self._http is None:
            self._http = httpx.Client(**self.control_plane.admin_client_options())
        return self._http

    def kubectl(self, *args: str, timeout: float = 60, check: bool = True) -> str:
        """The built kubectl as the cluster's admin (its context's namespace is `default`)."""
        kubectl = self.control_plane.layout.bin / "kubectl"
        result = subprocess.run(
            [str(kubectl), *args],
            text=True,
            capture_output=True,
            timeout=timeout,
            env=self.control_plane.kubectl_env(),
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout}{result.stderr}"
            )
        return result.stdout + result.stderr

    def get(self, path: str) -> dict[str, Any] | None:
        response = self.http().get(path)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def list(self, path: str, selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else None
        response = self.http().get(path, params=params)
        response.raise_for_status()
        return response.json()["items"]

    def audit_events(self) -> list[dict[str, Any]]:
        return self.control_plane.audit_events()

    def service_url(self, name: str) -> str:
        assert self.standins is not None
        return eventually(
            lambda: self.standins.proxies and self.standins.proxies.url(name),
            timeout=30,
            what=f"Service {name}'s stand-in listener",
        )

    def service_proxy(self, name: str, port: str = "http") -> PortProxy:
        """The stand-in listener of a Service's port (its endpoints, connections refused)."""
        proxies = self.standins.proxies if self.standins is not None else None
        proxy = proxies.proxy(name, port) if proxies is not None else None
        assert proxy is not None, f"no stand-in listener for Service {name} port {port}"
        return proxy

    def apiserver_proxy_url(self, service: str, port: str = "http") -> str:
        """The Service through the apiserver's service proxy."""
        return f"{self.server}/api/v1/namespaces/{NAMESPACE}/services/{service}:{port}/proxy"

    def start_cluster_autoscaler(
        self, group: NodeGroup, timers: Timers
    ) -> ClusterAutoscalerStandin:
        """The cluster autoscaler stand-in, on from now on, over the GPU node group."""
        assert self.standins is not None
        return self.standins.start_cluster_autoscaler(group, timers, self.env)

    def gpu_nodes(self) -> list[dict[str, Any]]:
        return self.list("/api/v1/nodes", f"{NODE_GROUP_LABEL}={GPU_GROUP}")

    def _pod_network(self, pod: Mapping[str, Any]) -> pod_network.PodNetwork | None:
        address = (pod.get("status") or {}).get("podIP")
        bridge = network.Bridge(self.control_plane.current.bridge)
        return pod_network.of_address(bridge, address) if address else None

    def crash_pod(self, name: str, namespace: str = NAMESPACE) -> list[int]:
        """SIGKILL every process in the pod's network namespace (its containers'), as an OOM
        kill or a crash would; restartPolicy Always then starts them again."""
        pod = self.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
        assert pod is not None, f"no pod {name}"
        net = self._pod_network(pod)
        assert net is not None, f"pod {name} has no address"
        killed = pod_network.processes_in(net.namespace_path)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        return killed

    def pod_processes(self) -> dict[str, list[int]]:
        """Pod name -> its live processes (those in its network namespace), every namespace."""
        found = {}
        for pod in self.list("/api/v1/pods"):
            net = self._pod_network(pod)
            pids = pod_network.processes_in(net.namespace_path) if net is not None else []
            if pids:
                found[pod["metadata"]["name"]] = pids
        return found

    # --- ending ----------------------------------------------------------------------------

    def live_processes(self) -> dict[str, list[int]]:
        """Everything this cluster started that is still alive: the components and kubelets
        (by process group), and anything in a pod network namespace of its bridge."""
        alive: dict[str, list[int]] = {}
        running = self.control_plane.layout.state.exists()
        pids = self.control_plane.current.pids if running else {}
        for name, pgid in {**pids, **self._stopped_pids}.items():
            members = process_group_members(pgid)
            if members:
                alive[name] = members
        bridge = self._bridge if self._bridge is not None else self.control_plane.current.bridge
        for net in pod_network.leftovers(network.Bridge(bridge)):
            alive[net.namespace] = pod_network.processes_in(net.namespace_path)
        return alive

    def stop(self) -> None:
        if self.standins is not None:
            self.standins.stop()
        if self._http is not None:
            self._http.close()
        if self.control_plane.layout.state.exists():
            self._stopped_pids = dict(self.control_plane.current.pids)
            self._bridge = self.control_plane.current.bridge
        self.control_plane.down()

    def diagnostics(self) -> str:
        """What explains a red run: the objects, the operator's log, the pods' logs."""
        sections = []
        for args in (
            ["get", "nodes,pllm,deploy,rs,pod,svc,pdb,hpa", "-A", "-o", "wide"],
            ["get", "pllm", "-o", "yaml"],
            [
                "get",
                "pods",
                "-A",
                "-o",
                "jsonpath={range .items[*]}{.metadata.name} "
                "{.metadata.deletionTimestamp} {.status.conditions}"
                " {.status.containerStatuses}{'\\n'}{end}",
            ],
            ["get", "events", "-A", "--sort-by=.lastTimestamp"],
        ):
            try:
                output = self.kubectl(*args, timeout=20, check=False)
            except (subprocess.TimeoutExpired, OSError) as error:
                output = f"({error})"
            sections.append((f"kubectl {' '.join(args)}", output))
        logs = self.control_plane.layout.logs
        for name in ("kube-controller-manager", "kube-scheduler", "standins"):
            sections.append((f"{name} log (tail)", _tail(logs / f"{name}.log", 40)))
        for path in sorted((self.control_plane.layout.root / "nodes").glob("*.log")):
            sections.append((f"kubelet {path.stem} (tail)", _tail(path, 30)))
        for path in sorted((self.control_plane.layout.root / "pods").glob("*/*.log")):
            sections.append((f"pod {path.parent.name}/{path.stem} (tail)", _tail(path, 40)))
        return "\n".join(f"===== {title}\n{body}" for title, body in sections)
