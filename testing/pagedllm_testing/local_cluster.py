"""The scenario's cluster on one machine, without Docker: the API emulator as its own process,
the Deployment controller, scheduler, kubelet, Service and EndpointSlice controller stand-ins
(and, once the scenario starts it, the cluster autoscaler stand-in) in a thread, over a system
node and a few GPU nodes (ClusterShape), the real operator as a local process started the way
manifests/operator.yaml starts it (its command, args and env, with short timers), and the real
kubectl through a kubeconfig pointing at the emulator.

Everything it starts runs in a process group of its own; `stop` ends them all, and
`live_processes` tells whether anything it started is still alive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kopf
import yaml

from pagedllm.kernels import cpu_extension
from pagedllm.operator.kube import KubeClient, now_rfc3339
from pagedllm_testing.cluster import binary
from pagedllm_testing.cluster_autoscaler_standin import ClusterAutoscalerStandin, NodeGroup, Timers
from pagedllm_testing.deployment_standin import DeploymentStandin
from pagedllm_testing.emulator.requests import REQUESTS_PATH
from pagedllm_testing.endpointslice_standin import EndpointSliceStandin
from pagedllm_testing.kubelet_standin import (
    LOOPBACK,
    KubeletStandin,
    free_port,
    process_group_members,
)
from pagedllm_testing.polling import eventually
from pagedllm_testing.scheduler_standin import (
    NODE_GROUP_LABEL,
    NODES,
    SchedulerStandin,
    SlotRule,
    node_manifest,
)
from pagedllm_testing.service_proxy import PortProxy, ServiceProxies

REPO = Path(__file__).resolve().parents[2]
# The virtual environment running the tests: where the image would have `pagedllm`.
BIN_DIR = Path(sys.executable).parent
OPERATOR_MANIFEST = REPO / "manifests" / "operator.yaml"
# The operator's timers, short: the scenario waits on them.
FAST_OPERATOR_ENV = {
    "PAGEDLLM_OPERATOR_RESYNC_SECONDS": "1",
    "PAGEDLLM_OPERATOR_WATCH_TIMEOUT_SECONDS": "60",
    "PAGEDLLM_OPERATOR_BACKOFF_SECONDS": "1",
    "PAGEDLLM_OPERATOR_BACKOFF_MAX_SECONDS": "5",
    "PAGEDLLM_OPERATOR_METRICS_TIMEOUT_SECONDS": "1",
}
STANDIN_INTERVAL = 0.25
# The namespace of the emulator's kubeconfig context, where the stand-ins run things.
NAMESPACE = "default"
# How the stand-ins name themselves to the API server (User-Agent, Events).
STANDINS_AGENT = "pagedllm-e2e-standins"
# The nodes: one without GPUs (routers and other CPU pods), and GPU nodes of the node group
# the cluster autoscaler stand-in manages, where the serving pods go; the CPU demo's serving
# pods stand in for pods asking for one GPU each (see scheduler_standin).
SYSTEM_NODE = "system-0"
GPU_GROUP = "gpu"
SLOT_RULE = SlotRule(labels={"app.kubernetes.io/name": "pagedllm"})


@dataclass(frozen=True)
class ClusterShape:
    """The GPU nodes the cluster starts with: enough for the scenario's first steps (three
    replicas, a rolling update's surge pod, and old pods still draining, which hold their
    GPUs until they are gone), one GPU each."""

    gpu_nodes: int = 6
    gpus_per_node: int = 1


def _tail(path: Path, lines: int) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Standins:
    """The controllers and the node a cluster would have, on an event loop in a thread."""

    def __init__(
        self, server: str, namespace: str, root: Path, kubeconfig: Path, shape: ClusterShape
    ):
        self.server, self.namespace, self.root = server, namespace, root
        self.kubeconfig = kubeconfig
        self.shape = shape
        self.log_path = root / "standins.log"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="standins", daemon=True)
        self.kubelet: KubeletStandin | None = None
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
        # The emulator's kubeconfig has no credentials: its server address is the login.
        kube = KubeClient(lambda: kopf.ConnectionInfo(server=self.server), agent=STANDINS_AGENT)
        deployments = DeploymentStandin(kube, self.namespace)
        self.kubelet = KubeletStandin(
            kube, self.namespace, self.root / "pods", [str(BIN_DIR)], kubeconfig=self.kubeconfig
        )
        self.proxies = ServiceProxies(kube, self.namespace)
        slices = EndpointSliceStandin(kube, self.namespace)
        self.http = httpx.AsyncClient(base_url=self.server, timeout=10, trust_env=False)
        scheduler = SchedulerStandin(self.http, self.namespace, SLOT_RULE)
        await self._add_node(SYSTEM_NODE, 0)
        for index in range(self.shape.gpu_nodes):
            await self._add_node(f"{GPU_GROUP}-{index}", self.shape.gpus_per_node, GPU_GROUP)
        try:
            while not self._stop.is_set():
                for sync in (
                    lambda: deployments.sync(now_rfc3339()),
                    scheduler.sync,
                    self.kubelet.sync,
                    self.proxies.sync,
                    slices.sync,
                    self._autoscale,
                ):
                    try:
                        await sync()
                    except Exception:
                        with self.log_path.open("a") as log:
                            log.write(f"{now_rfc3339()} {traceback.format_exc()}\n")
                await asyncio.sleep(STANDIN_INTERVAL)
        finally:
            await self.kubelet.shutdown()
            await self.proxies.close()
            await self.http.aclose()
            await kube.close()

    async def _add_node(self, name: str, gpus: int, group: str | None = None) -> None:
        assert self.http is not None
        node, status = node_manifest(name, gpus, group)
        (await self.http.post(NODES, json=node)).raise_for_status()
        (
            await self.http.patch(
                f"{NODES}/{name}/status",
                json=status,
                headers={"Content-Type": "application/merge-patch+json"},
            )
        ).raise_for_status()

    async def _autoscale(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.tick()

    def start_cluster_autoscaler(
        self, group: NodeGroup, timers: Timers
    ) -> ClusterAutoscalerStandin:
        assert self.http is not None, "the stand-ins are not running"
        self.autoscaler = ClusterAutoscalerStandin(
            self.http, self.namespace, group, timers, SLOT_RULE
        )
        return self.autoscaler

    def service_url(self, name: str, port: str = "http") -> str | None:
        return self.proxies.url(name, port) if self.proxies is not None else None

    def stop(self) -> None:
        """Stop the loop, killing every pod process still running (a node lost)."""
        self._stop.set()
        if self._done is not None:
            try:
                self._done.result(timeout=30)
            finally:
                if self.kubelet is not None:
                    self.kubelet.kill_everything()
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout=10)


class LocalProcess:
    """A child process in its own process group, logging to a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path):
        self.name, self.log_path = name, log_path
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self, grace: float = 10) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def log(self, lines: int = 200) -> str:
        return _tail(self.log_path, lines)


class LocalCluster:
    def __init__(self, workdir: Path, shape: ClusterShape | None = None):
        self.workdir = workdir
        self.shape = shape or ClusterShape()
        self.kubeconfig = workdir / "kubeconfig"
        self.api_server: LocalProcess | None = None
        self.operator: LocalProcess | None = None
        self.standins: Standins | None = None
        self.server = ""

    # --- starting -------------------------------------------------------------------------

    def start_api_server(self) -> None:
        self.api_server = LocalProcess(
            "kube-emulator",
            [
                sys.executable,
                "-m",
                "pagedllm_testing.emulator",
                "--port",
                "0",
                "--kubeconfig",
                str(self.kubeconfig),
            ],
            {**os.environ},
            self.workdir,
            self.workdir / "emulator.log",
        )
        eventually(
            lambda: self.kubeconfig.exists() or self._exited(self.api_server),
            timeout=30,
            what="the API emulator",
        )
        self._check_running(self.api_server)
        config = yaml.safe_load(self.kubeconfig.read_text())
        self.server = config["clusters"][0]["cluster"]["server"]
        # The image's build step: its CPU kernels, compiled once, read by every pod.
        assert cpu_extension.load(), "the CPU kernels did not build"
        self.standins = Standins(self.server, NAMESPACE, self.workdir, self.kubeconfig, self.shape)
        self.standins.start()
        eventually(
            lambda: len(self.list(NODES)) == 1 + self.shape.gpu_nodes,
            timeout=30,
            what="the nodes to register",
        )

    def start_operator(self) -> None:
        """The operator Deployment's container, run here: same command, args and env, with
        short timers and its liveness endpoint on a free loopback port."""
        manifest = yaml.safe_load(OPERATOR_MANIFEST.read_text())
        container = manifest["spec"]["template"]["spec"]["containers"][0]
        health_port = free_port(set())
        args = [
            f"--liveness=http://{LOOPBACK}:{health_port}/healthz"
            if arg.startswith("--liveness=")
            else arg
            for arg in container.get("args", [])
        ]
        env = {
            "PATH": f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": str(self.workdir),
            "KUBECONFIG": str(self.kubeconfig),
            **{item["name"]: item["value"] for item in container.get("env") or []},
            **FAST_OPERATOR_ENV,
        }
        executable = shutil.which(container["command"][0], path=env["PATH"])
        assert executable is not None, f"{container['command'][0]} is not installed"
        # Not the repository root: there the folder operator/ would shadow the standard
        # library's `operator` module.
        self.operator = LocalProcess(
            "operator",
            [executable, *container["command"][1:], *args],
            env,
            self.workdir,
            self.workdir / "operator.log",
        )

        def healthy() -> bool:
            self._check_running(self.operator)
            try:
                return (
                    httpx.get(
                        f"http://{LOOPBACK}:{health_port}/healthz", timeout=1, trust_env=False
                    ).status_code
                    == 200
                )
            except httpx.HTTPError:
                return False

        eventually(healthy, timeout=60, what="the operator's liveness endpoint")

    @staticmethod
    def _exited(process: LocalProcess | None) -> bool:
        return process is not None and process.process.poll() is not None

    def _check_running(self, process: LocalProcess | None) -> None:
        if self._exited(process):
            assert process is not None
            raise AssertionError(
                f"{process.name} exited with code {process.process.returncode}:\n{process.log(60)}"
            )

    # --- using -----------------------------------------------------------------------------

    def kubectl(self, *args: str, timeout: float = 60, check: bool = True) -> str:
        """kubectl with the emulator's kubeconfig (its context's namespace is `default`)."""
        result = subprocess.run(
            [binary.kubectl(), *args],
            text=True,
            capture_output=True,
            timeout=timeout,
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout}{result.stderr}"
            )
        return result.stdout + result.stderr

    def get(self, path: str) -> dict[str, Any] | None:
        response = httpx.get(self.server + path, timeout=10, trust_env=False)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def requests(self, since: int = 0, agents: tuple[str, ...] = ()) -> dict[str, Any]:
        """The emulator's count of the requests it served (pagedllm_testing.emulator.requests)."""
        params: list[tuple[str, str | int]] = [("since", since), *(("agent", a) for a in agents)]
        response = httpx.get(
            self.server + REQUESTS_PATH, params=params, timeout=10, trust_env=False
        )
        response.raise_for_status()
        return response.json()

    def list(self, path: str, selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else None
        response = httpx.get(self.server + path, params=params, timeout=10, trust_env=False)
        response.raise_for_status()
        return response.json()["items"]

    def service_url(self, name: str) -> str:
        assert self.standins is not None
        return eventually(
            lambda: self.standins.service_url(name),
            timeout=30,
            what=f"Service {name}'s stand-in listener",
        )

    def service_proxy(self, name: str, port: str = "http") -> PortProxy:
        """The stand-in listener of a Service's port (its endpoints, connections refused)."""
        proxies = self.standins.proxies if self.standins is not None else None
        proxy = proxies.proxy(name, port) if proxies is not None else None
        assert proxy is not None, f"no stand-in listener for Service {name} port {port}"
        return proxy

    def start_cluster_autoscaler(
        self, group: NodeGroup, timers: Timers
    ) -> ClusterAutoscalerStandin:
        """The cluster autoscaler stand-in, on from now on, over the GPU node group."""
        assert self.standins is not None
        return self.standins.start_cluster_autoscaler(group, timers)

    def gpu_nodes(self) -> list[dict[str, Any]]:
        return self.list(NODES, f"{NODE_GROUP_LABEL}={GPU_GROUP}")

    def crash_pod(self, name: str) -> list[int]:
        """SIGKILL the pod's processes (see KubeletStandin.crash)."""
        assert self.standins is not None and self.standins.kubelet is not None
        return self.standins.kubelet.crash(name)

    def pod_processes(self) -> dict[str, list[int]]:
        """Pod name -> its live processes."""
        kubelet = self.standins.kubelet if self.standins else None
        return kubelet.live_processes() if kubelet is not None else {}

    # --- ending ----------------------------------------------------------------------------

    def live_processes(self) -> dict[str, list[int]]:
        """Everything this cluster started that is still alive: pods, operator, emulator."""
        alive = dict(self.pod_processes())
        for process in (self.operator, self.api_server):
            if process is not None:
                members = process_group_members(process.process.pid)
                if members:
                    alive[process.name] = members
        return alive

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        if self.standins is not None:
            self.standins.stop()
        if self.api_server is not None:
            self.api_server.stop()

    def diagnostics(self) -> str:
        """What explains a red run: the objects, the operator's log, the pods' logs."""
        sections = []
        if self.api_server is not None and not self._exited(self.api_server):
            for args in (
                ["get", "nodes,pllm,deploy,rs,pod,svc,pdb", "-o", "wide"],
                ["get", "pllm", "-o", "yaml"],
                [
                    "get",
                    "deploy",
                    "-o",
                    "jsonpath={range .items[*]}{.metadata.name}"
                    " generation={.metadata.generation} {.status}{'\\n'}{end}",
                ],
                [
                    "get",
                    "pods",
                    "-o",
                    "jsonpath={range .items[*]}{.metadata.name} "
                    "{.metadata.deletionTimestamp} {.status.conditions}"
                    " {.status.containerStatuses}{'\\n'}{end}",
                ],
                ["get", "events", "--sort-by=.lastTimestamp"],
            ):
                try:
                    output = self.kubectl(*args, timeout=20, check=False)
                except subprocess.TimeoutExpired:
                    output = "(timed out)"
                sections.append((f"kubectl {' '.join(args)}", output))
        for process in (self.operator, self.api_server):
            if process is not None:
                sections.append((f"{process.name} log (tail)", process.log(150)))
        sections.append(("stand-ins log (tail)", _tail(self.workdir / "standins.log", 80)))
        kubelet = self.standins.kubelet if self.standins else None
        for name, path in (kubelet.logs() if kubelet else {}).items():
            sections.append((f"pod {name} log (tail)", _tail(path, 40)))
        return "\n".join(f"===== {title}\n{body}" for title, body in sections)
