"""A stand-in for the kubelet (test infrastructure): runs the pods of one namespace as local
processes and reports them as Pod status, the way the real kubelet runs containers. It stands
in for every node's kubelet at once: a pod runs once it is bound to a node (spec.nodeName, see
scheduler_standin.py); an unbound pod that is deleted just goes.

- Each container runs the command and args of the pod spec with the pod spec's env, looked up
  on PATH with the given directories first (the project's virtual environment, where the
  image has `pagedllm`), in a process group of its own, logging to ROOT/POD/CONTAINER.log.
  Only the image's own ENV (manifests/Dockerfile) and PATH come from outside the pod spec.
- Networking: every declared container port gets a free loopback port. The value after
  `--port` (when it is a declared container port) and the value after `--host` are rewritten
  to them; status.podIP is 127.0.0.1. The mapping is recorded on the pod for the Service
  stand-in (annotation e2e.pagedllm.io/host-ports) and for the operator's autoscaler (its
  documented pagedllm.io/metrics-port override names the metrics port).
- Volumes: emptyDirs (any medium) are directories under ROOT/POD. configMap volumes are too,
  holding a file per key (or per `items` entry), written before the containers start and
  refreshed in place while the pod runs (every CONFIG_MAP_REFRESH_SECONDS here; within a
  minute or so on a real kubelet), each file replaced atomically. Env values and args naming
  a mount path are rewritten to the directory, and a /tmp mount becomes TMPDIR.
- Env: plain values, secretKeyRef and configMapKeyRef (read from the API, `optional`
  honoured), fieldRef to metadata.name, metadata.namespace and status.podIP.
- Service-account credentials: a pod whose automountServiceAccountToken is not false gets
  KUBECONFIG naming the cluster's kubeconfig instead of the token files a kubelet mounts under
  /var/run/secrets/kubernetes.io/serviceaccount (fixed absolute paths that a local process
  cannot be given); clients that fall back from in-cluster credentials to the kubeconfig, as
  the `kubernetes` package's users commonly do, reach the API server either way.
- Init containers run in order, each to success, before the containers start.
- Probes: httpGet and tcpSocket startup and readiness probes with their thresholds, at their
  periodSeconds but at most every `max_probe_period` seconds (fast CI). Readiness is the
  pod's Ready condition. restartPolicy Always: a container that exits is started again after
  an exponential back-off, shown as CrashLoopBackOff with the last exit code.
- `crash(pod)` SIGKILLs every process of a pod's containers, as an OOM kill or a crash
  would; restartPolicy Always then starts them again.
- Deletion is graceful: pods carry KUBELET_FINALIZER (the emulator has no graceful pod
  deletion of its own), so a deleted pod stays Terminating while the preStop exec hooks run,
  then SIGTERM goes to each container's main process (as a container runtime signals PID 1),
  and what is left of its process group when terminationGracePeriodSeconds is over gets
  SIGKILL. Then the finalizer goes and so does the pod.

Not emulated: images (the host's files are the image), users and security contexts,
resource limits, liveness probes, volumes other than emptyDir and configMap, RBAC (the
kubeconfig's user may do anything).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pagedllm.kernels import cpu_extension
from pagedllm.operator.children import METRICS_PORT_ANNOTATION
from pagedllm.operator.kube import KubeClient, KubeError, now_rfc3339
from pagedllm_testing.deployment_standin import KUBELET_FINALIZER, is_terminating

HOST_PORTS_ANNOTATION = "e2e.pagedllm.io/host-ports"
LOOPBACK = "127.0.0.1"
# The ENV lines of manifests/Dockerfile: what the image gives every container. Its CPU kernels
# are built into the image; here, the machine's own build stands in (see LocalCluster).
IMAGE_ENV = {
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    cpu_extension.KERNEL_DIR_ENV: str(cpu_extension.build_dir().parent),
}
DEFAULT_GRACE_SECONDS = 30
MAX_RESTART_BACKOFF = 20.0
POLL_SECONDS = 0.1
CONFIG_MAP_REFRESH_SECONDS = 1.0


def local_url(pod: Mapping[str, Any], port: int = 8000) -> str:
    """The pod's container port on loopback (this stand-in's mapping of it)."""
    ports = json.loads(pod["metadata"]["annotations"][HOST_PORTS_ANNOTATION])
    return f"http://{LOOPBACK}:{ports[str(port)]}"


def cpu_quantity(text: str) -> float:
    """CPUs in a Kubernetes quantity: ``2``, ``0.5``, ``250m``."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def resource_field(container: Mapping[str, Any], ref: Mapping[str, Any], name: str) -> str:
    """A resourceFieldRef as the kubelet resolves it, for CPU: the container's request or
    limit over the divisor, rounded up; an unset limit is the node's CPUs, an unset request 0."""
    resource = ref.get("resource", "")
    kind, _, what = resource.partition(".")
    if what != "cpu" or kind not in ("requests", "limits"):
        raise PodConfigError(f"env {name}: resourceFieldRef {resource} is not emulated")
    value = ((container.get("resources") or {}).get(kind) or {}).get("cpu")
    if value is None:
        cpus = float(os.cpu_count() or 1) if kind == "limits" else 0.0
    else:
        cpus = cpu_quantity(str(value))
    return str(math.ceil(cpus / cpu_quantity(str(ref.get("divisor", "1")))))


class PodConfigError(Exception):
    """The pod cannot start as specified (a missing Secret key, an unsupported volume)."""


def free_port(taken: set[int]) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind((LOOPBACK, 0))
            port = sock.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


def volume_dirs(pod_spec: Mapping[str, Any], pod_dir: Path) -> dict[str, Path]:
    dirs = {}
    for volume in pod_spec.get("volumes") or []:
        if "emptyDir" not in volume and "configMap" not in volume:
            raise PodConfigError(
                f"volume {volume['name']}: only emptyDir and configMap volumes run here"
            )
        dirs[volume["name"]] = pod_dir / volume["name"]
    return dirs


def config_map_files(
    source: Mapping[str, Any], config_map: Mapping[str, Any] | None
) -> dict[str, str]:
    """What a configMap volume holds: relative path -> content (its keys, or its `items`);
    PodConfigError for a ConfigMap or key that is missing and not optional."""
    name = source.get("name", "")
    optional = bool(source.get("optional"))
    if config_map is None:
        if optional:
            return {}
        raise PodConfigError(f'configmap "{name}" not found')
    data = config_map.get("data") or {}
    items = source.get("items")
    if items is None:
        return dict(data)
    files = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise PodConfigError(f'configmap "{name}" key "{item["key"]}" not found')
        files[item["path"]] = data[item["key"]]
    return files


def project_files(directory: Path, files: Mapping[str, str]) -> None:
    """Make `directory` hold exactly `files`, each changed one replaced atomically (a reader
    sees the old content or the new one, never half of it)."""
    for relative, content in files.items():
        path = directory / relative
        if path.is_file() and path.read_text() == content:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.tmp")
        staged.write_text(content)
        staged.replace(path)
    for path in directory.rglob("*"):
        if path.is_file() and str(path.relative_to(directory)) not in files:
            path.unlink()


def mounts_of(container: Mapping[str, Any], dirs: Mapping[str, Path]) -> list[tuple[str, Path]]:
    """(mount path, local directory), longest mount path first."""
    mounts = [
        (m["mountPath"].rstrip("/") or "/", dirs[m["name"]])
        for m in container.get("volumeMounts") or []
    ]
    return sorted(mounts, key=lambda mount: len(mount[0]), reverse=True)


def rewrite_path(text: str, mounts: Sequence[tuple[str, Path]]) -> str:
    """A path under a mount moved to the mount's directory (also in `--flag=PATH`)."""
    if text.startswith("-") and "=" in text:
        flag, _, value = text.partition("=")
        return f"{flag}={rewrite_path(value, mounts)}"
    for mount_path, directory in mounts:
        if text == mount_path or text.startswith(mount_path + "/"):
            return str(directory) + text[len(mount_path) :]
    return text


def local_args(
    args: Sequence[str], host_ports: Mapping[int, int], mounts: Sequence[tuple[str, Path]]
) -> list[str]:
    result: list[str] = []
    for arg in args:
        previous = result[-1] if result else ""
        if previous == "--host":
            result.append(LOOPBACK)
        elif previous == "--port" and arg.isdigit() and int(arg) in host_ports:
            result.append(str(host_ports[int(arg)]))
        elif arg.startswith("--port=") and arg[7:].isdigit() and int(arg[7:]) in host_ports:
            result.append(f"--port={host_ports[int(arg[7:])]}")
        elif arg.startswith("--host="):
            result.append(f"--host={LOOPBACK}")
        else:
            result.append(rewrite_path(arg, mounts))
    return result


def declared_ports(pod_spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        port
        for container in pod_spec.get("containers") or []
        for port in container.get("ports") or []
    ]


def process_group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _kill_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


@dataclass
class ContainerRun:
    spec: dict[str, Any]
    process: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    started_at: str = ""
    started: bool = False
    ready: bool = False
    restarts: int = 0
    waiting: tuple[str, str] | None = ("ContainerCreating", "")
    terminated: dict[str, Any] | None = None
    last_terminated: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def status(self) -> dict[str, Any]:
        if self.running:
            state: dict[str, Any] = {"running": {"startedAt": self.started_at}}
        elif self.terminated is not None:
            state = {"terminated": self.terminated}
        else:
            reason, message = self.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        status = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready and self.running,
            "restartCount": self.restarts,
            "started": self.started and self.running,
            "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        if self.process is not None:
            status["containerID"] = f"local://{self.process.pid}"
        return status


def _terminated(code: int, started_at: str) -> dict[str, Any]:
    if code < 0:  # killed by a signal: a shell's exit code, as container runtimes report
        return {
            "exitCode": 128 - code,
            "signal": -code,
            "reason": "Error",
            "startedAt": started_at,
            "finishedAt": now_rfc3339(),
        }
    return {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "startedAt": started_at,
        "finishedAt": now_rfc3339(),
    }


class LocalPod:
    """One pod's containers as local processes, and the Pod status they amount to."""

    def __init__(self, kubelet: KubeletStandin, pod: dict[str, Any]):
        self.kubelet = kubelet
        self.name = pod["metadata"]["name"]
        self.uid = pod["metadata"]["uid"]
        self.spec = pod["spec"]
        self.annotations = pod["metadata"].get("annotations") or {}
        self.dir = kubelet.root / self.name
        self.dirs: dict[str, Path] = {}
        self.host_ports: dict[int, int] = {}
        self.init_containers = [ContainerRun(c) for c in self.spec.get("initContainers") or []]
        self.containers = [ContainerRun(c) for c in self.spec.get("containers") or []]
        self.initialized = not self.init_containers
        self.created_at = now_rfc3339()
        self.process_groups: list[int] = []
        self.terminating = False
        self.finished = False
        self.task: asyncio.Task[None] | None = None
        self._published: dict[str, Any] | None = None
        self._publish_lock = asyncio.Lock()

    def log_path(self, container: ContainerRun) -> Path:
        return self.dir / f"{container.name}.log"

    # --- status ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        ready = (
            not self.terminating
            and bool(self.containers)
            and all(c.ready and c.running for c in self.containers)
        )
        ever_ran = any(c.process is not None for c in self.containers)
        if self.finished:
            failed = any((c.terminated or {}).get("exitCode", 0) != 0 for c in self.containers)
            phase = "Failed" if failed else "Succeeded"
        else:
            phase = "Running" if ever_ran else "Pending"

        def condition(kind: str, value: bool) -> dict[str, Any]:
            return {
                "type": kind,
                "status": "True" if value else "False",
                "lastTransitionTime": self.created_at,
            }

        return {
            "phase": phase,
            "hostIP": LOOPBACK,
            "podIP": LOOPBACK,
            "podIPs": [{"ip": LOOPBACK}],
            "startTime": self.created_at,
            "conditions": [
                condition("PodScheduled", True),
                condition("Initialized", self.initialized),
                condition("ContainersReady", ready),
                condition("Ready", ready),
            ],
            "initContainerStatuses": [c.status() for c in self.init_containers],
            "containerStatuses": [c.status() for c in self.containers],
        }

    async def publish(self, *, api: bool = True) -> None:
        async with self._publish_lock:
            status = self.status()
            if status == self._published or not api:
                return
            await self.kubelet.kube.merge_patch(
                "v1",
                "Pod",
                self.name,
                self.kubelet.namespace,
                {"status": status},
                subresource="status",
                missing_ok=True,
            )
            self._published = status

    # --- starting ----------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Directories and ports, recorded on the pod before anything starts."""
        self.dirs = volume_dirs(self.spec, self.dir)
        for directory in [self.dir, *self.dirs.values()]:
            directory.mkdir(parents=True, exist_ok=True)
        for name in self.config_map_names():
            obj = await self.kubelet.kube.get("v1", "ConfigMap", name, self.kubelet.namespace)
            self.project_config_maps({name: obj} if obj is not None else {})
        ports = declared_ports(self.spec)
        self.host_ports = {p["containerPort"]: free_port(self.kubelet.ports_taken) for p in ports}
        annotations = {
            HOST_PORTS_ANNOTATION: json.dumps({str(k): v for k, v in self.host_ports.items()})
        }
        metrics_port = self._metrics_container_port(ports)
        if metrics_port in self.host_ports:
            annotations[METRICS_PORT_ANNOTATION] = str(self.host_ports[metrics_port])
        await self.kubelet.kube.merge_patch(
            "v1",
            "Pod",
            self.name,
            self.kubelet.namespace,
            {"metadata": {"annotations": annotations}},
            missing_ok=True,
        )

    def config_map_names(self) -> list[str]:
        return [v["configMap"]["name"] for v in self.spec.get("volumes") or [] if "configMap" in v]

    def project_config_maps(self, config_maps: Mapping[str, Mapping[str, Any]]) -> None:
        """Write (or refresh) every configMap volume from `config_maps` (name -> object)."""
        for volume in self.spec.get("volumes") or []:
            source = volume.get("configMap")
            if source is not None:
                files = config_map_files(source, config_maps.get(source["name"]))
                project_files(self.dirs[volume["name"]], files)

    def _metrics_container_port(self, ports: Sequence[Mapping[str, Any]]) -> int | None:
        declared = self.annotations.get("prometheus.io/port")
        if declared and declared.isdigit():
            return int(declared)
        return next((p["containerPort"] for p in ports if p.get("name") == "http"), None)

    async def _env(
        self, container: Mapping[str, Any], mounts: Sequence[tuple[str, Path]]
    ) -> dict[str, str]:
        env = {"PATH": self.kubelet.path_variable, "HOSTNAME": self.name, **IMAGE_ENV}
        if self.kubelet.kubeconfig is not None and self.spec.get(
            "automountServiceAccountToken", True
        ):
            env["KUBECONFIG"] = str(self.kubelet.kubeconfig)
        tmp = next((directory for path, directory in mounts if path == "/tmp"), None)
        if tmp is not None:
            env["TMPDIR"] = str(tmp)
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = rewrite_path(str(item["value"]), mounts)
                continue
            value = await self._env_from(item.get("valueFrom") or {}, item["name"], container)
            if value is not None:
                env[item["name"]] = value
        return env

    async def _env_from(
        self, source: Mapping[str, Any], name: str, container: Mapping[str, Any]
    ) -> str | None:
        resource_ref = source.get("resourceFieldRef")
        if resource_ref is not None:
            return resource_field(container, resource_ref, name)
        field_ref = source.get("fieldRef")
        if field_ref is not None:
            values = {
                "metadata.name": self.name,
                "metadata.namespace": self.kubelet.namespace,
                "status.podIP": LOOPBACK,
            }
            if field_ref.get("fieldPath") not in values:
                raise PodConfigError(
                    f"env {name}: fieldRef {field_ref.get('fieldPath')} is not emulated"
                )
            return values[field_ref["fieldPath"]]
        for kind, object_kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
            ref = source.get(kind)
            if ref is None:
                continue
            obj = await self.kubelet.kube.get(
                "v1", object_kind, ref["name"], self.kubelet.namespace
            )
            data = (obj or {}).get("data") or {}
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                what = "secret" if kind == "secretKeyRef" else "configmap"
                raise PodConfigError(f'{what} "{ref["name"]}" key "{ref["key"]}" not found')
            value = data[ref["key"]]
            return base64.b64decode(value).decode() if kind == "secretKeyRef" else value
        raise PodConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")

    def _spawn(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        executable = shutil.which(argv[0], path=env["PATH"])
        if executable is None:
            raise FileNotFoundError(f'exec: "{argv[0]}": executable file not found in $PATH')
        with log.open("ab") as out:
            process = subprocess.Popen(
                [executable, *argv[1:]],
                env=env,
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.process_groups.append(process.pid)
        return process

    async def _start(self, run: ContainerRun) -> None:
        spec = run.spec
        mounts = mounts_of(spec, self.dirs)
        run.env = await self._env(spec, mounts)
        command = spec.get("command") or []
        if not command:
            raise PodConfigError(
                f"container {run.name}: no command (the image's own entrypoint is not known here)"
            )
        argv = [*command, *local_args(spec.get("args") or [], self.host_ports, mounts)]
        run.process = self._spawn(argv, run.env, self.log_path(run))
        run.started_at = now_rfc3339()
        run.waiting = None
        run.terminated = None
        run.started = run.ready = False

    # --- running ----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        except Exception:
            with (self.dir / "kubelet.log").open("a") as log:
                log.write(f"the kubelet stand-in failed on this pod:\n{traceback.format_exc()}")
            raise

    async def _run(self) -> None:
        try:
            await self.prepare()
        except PodConfigError as error:
            for run in [*self.init_containers, *self.containers]:
                run.waiting = ("CreateContainerConfigError", str(error))
            await self.publish()
            return
        await self.publish()
        for init in self.init_containers:
            await self._run_until_success(init)
        self.initialized = True
        await self.publish()
        await asyncio.gather(*(self._keep_running(c) for c in self.containers))

    async def _run_until_success(self, run: ContainerRun) -> None:
        backoff = 1.0
        while True:
            if await self._start_or_wait(run):
                await self.publish()
                while run.running:
                    await asyncio.sleep(POLL_SECONDS)
                code = run.process.returncode if run.process else 1
                run.terminated = _terminated(code, run.started_at)
                if code == 0:
                    await self.publish()
                    return
                run.last_terminated, run.terminated = run.terminated, None
                run.restarts += 1
                run.waiting = (
                    "CrashLoopBackOff",
                    f"back-off {backoff:g}s restarting failed container={run.name} pod={self.name}",
                )
                await self.publish()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_RESTART_BACKOFF)

    async def _start_or_wait(self, run: ContainerRun) -> bool:
        try:
            await self._start(run)
            return True
        except PodConfigError as error:
            run.waiting = ("CreateContainerConfigError", str(error))
        except OSError as error:
            run.waiting = ("RunContainerError", str(error))
        await self.publish()
        return False

    async def _keep_running(self, run: ContainerRun) -> None:
        backoff = 1.0
        while True:
            if await self._start_or_wait(run):
                await self.publish()
                await self._probe_until_exit(run)
                assert run.process is not None
                run.last_terminated = _terminated(run.process.returncode, run.started_at)
                run.restarts += 1
                run.ready = run.started = False
                run.waiting = (
                    "CrashLoopBackOff",
                    f"back-off {backoff:g}s restarting failed container={run.name} pod={self.name}",
                )
                await self.publish()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_RESTART_BACKOFF)

    def _period(self, probe: Mapping[str, Any]) -> float:
        return min(float(probe.get("periodSeconds", 10)), self.kubelet.max_probe_period)

    async def _sleep_while_running(self, run: ContainerRun, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while run.running and time.monotonic() < deadline:
            await asyncio.sleep(min(POLL_SECONDS, max(deadline - time.monotonic(), 0)))

    async def _probe_until_exit(self, run: ContainerRun) -> None:
        startup = run.spec.get("startupProbe")
        readiness = run.spec.get("readinessProbe")
        first = startup or readiness
        if first:
            await self._sleep_while_running(
                run, min(float(first.get("initialDelaySeconds", 0)), self.kubelet.max_probe_period)
            )
        failures = 0
        while run.running and startup is not None and not run.started:
            if await self._probe(run, startup):
                run.started = True
                break
            failures += 1
            if failures >= startup.get("failureThreshold", 3):
                _kill_group(run.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
                break
            await self._sleep_while_running(run, self._period(startup))
        run.started = run.running
        failures = 0
        while run.running:
            if readiness is None:
                run.ready = True
            elif await self._probe(run, readiness):
                run.ready, failures = True, 0
            else:
                failures += 1
                if failures >= readiness.get("failureThreshold", 3):
                    run.ready = False
            await self.publish()
            await self._sleep_while_running(
                run, self._period(readiness) if readiness else POLL_SECONDS * 5
            )
        await self.publish()

    def _probe_port(self, run: ContainerRun, port: int | str) -> int | None:
        if isinstance(port, str) and not port.isdigit():
            port = next(
                (p["containerPort"] for p in run.spec.get("ports") or [] if p.get("name") == port),
                -1,
            )
        return self.host_ports.get(int(port))

    async def _probe(self, run: ContainerRun, probe: Mapping[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            action = probe["httpGet"]
            port = self._probe_port(run, action["port"])
            if port is None:
                return False
            try:
                response = await self.kubelet.http.get(
                    f"http://{LOOPBACK}:{port}{action.get('path', '/')}", timeout=timeout
                )
            except httpx.HTTPError:
                return False
            return 200 <= response.status_code < 400
        if "tcpSocket" in probe:
            port = self._probe_port(run, probe["tcpSocket"]["port"])
            if port is None:
                return False
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(LOOPBACK, port), timeout)
            except (OSError, asyncio.TimeoutError):
                return False
            writer.close()
            return True
        raise PodConfigError(f"container {run.name}: only httpGet and tcpSocket probes run here")

    # --- stopping ----------------------------------------------------------------------------

    async def terminate(self, grace: float, *, api: bool = True) -> None:
        """Graceful stop: preStop hooks, SIGTERM, SIGKILL after the grace period, and (with
        `api`) the finalizer removed so the pod object goes."""
        self.terminating = True
        deadline = time.monotonic() + grace
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        running = [c for c in [*self.init_containers, *self.containers] if c.running]
        with contextlib.suppress(KubeError):
            await self.publish(api=api)
        await asyncio.gather(*(self._pre_stop(c, deadline) for c in running))
        for run in running:
            with contextlib.suppress(ProcessLookupError):
                run.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        while any(c.running for c in running) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        self.kill_all()
        for run in running:
            run.process.wait()  # type: ignore[union-attr]
            run.terminated = _terminated(
                run.process.returncode,  # type: ignore[union-attr]
                run.started_at,
            )
            run.ready = False
        self.finished = True
        if api:
            with contextlib.suppress(KubeError):
                await self.publish()
                await self.kubelet.release(self.name)

    async def _pre_stop(self, run: ContainerRun, deadline: float) -> None:
        hook = ((run.spec.get("lifecycle") or {}).get("preStop") or {}).get("exec")
        if not hook:
            return
        try:
            process = self._spawn(list(hook["command"]), run.env, self.log_path(run))
        except OSError as error:
            with self.log_path(run).open("a") as log:
                log.write(f"preStop hook failed: {error}\n")
            return
        while process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        _kill_group(process.pid, signal.SIGKILL)
        process.wait()

    def kill_all(self) -> None:
        """SIGKILL to every process group this pod started (what a container runtime does
        when the grace period is over)."""
        for pgid in self.process_groups:
            _kill_group(pgid, signal.SIGKILL)
        for run in [*self.init_containers, *self.containers]:
            if run.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.process.wait(timeout=5)

    def live_processes(self) -> list[int]:
        return [pid for pgid in self.process_groups for pid in process_group_members(pgid)]


class KubeletStandin:
    """All pods of one namespace, started, probed and stopped as the real kubelet would."""

    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        root: Path,
        bin_dirs: Sequence[str],
        max_probe_period: float = 1.0,
        kubeconfig: Path | None = None,
    ):
        self.kube = kube
        # What pods with service-account credentials get (see the module's docstring).
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.root = root
        self.path_variable = os.pathsep.join([*bin_dirs, os.environ.get("PATH", "")])
        self.max_probe_period = max_probe_period
        self.pods: dict[str, LocalPod] = {}
        self.ports_taken: set[int] = set()
        self.http = httpx.AsyncClient(trust_env=False)
        self._stopping: set[asyncio.Task[None]] = set()
        self._config_maps_refreshed = 0.0

    async def shutdown(self) -> None:
        """Kill every pod process at once (the node is lost) and stop all pod work."""
        tasks = [*self._stopping, *(p.task for p in self.pods.values() if p.task)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.kill_everything()
        await self.http.aclose()

    async def sync(self) -> None:
        pods = await self.kube.list("v1", "Pod", self.namespace)
        seen = set()
        for pod in pods:
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            local = self.pods.get(uid)
            if is_terminating(pod):
                if local is None:
                    await self.release(pod["metadata"]["name"])
                elif not local.terminating:
                    grace = pod["metadata"].get(
                        "deletionGracePeriodSeconds",
                        pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS),
                    )
                    self._stop(local.terminate(float(grace)))
                continue
            if local is None:
                if not pod["spec"].get("nodeName"):
                    continue  # not scheduled yet (see scheduler_standin)
                local = self.pods[uid] = LocalPod(self, pod)
                local.task = asyncio.get_running_loop().create_task(local.run())
        await self._refresh_config_maps()
        for uid, local in self.pods.items():
            if uid not in seen and not local.terminating:
                # Removed without a graceful deletion (e.g. forced): stop it all the same.
                grace = local.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
                self._stop(local.terminate(float(grace), api=False))

    async def _refresh_config_maps(self) -> None:
        """Bring the running pods' configMap volumes up to date (one list for them all)."""
        running = [
            p for p in self.pods.values() if p.dirs and not p.terminating and p.config_map_names()
        ]
        now = time.monotonic()
        if not running or now - self._config_maps_refreshed < CONFIG_MAP_REFRESH_SECONDS:
            return
        self._config_maps_refreshed = now
        listed = await self.kube.list("v1", "ConfigMap", self.namespace)
        config_maps = {item["metadata"]["name"]: item for item in listed}
        for local in running:
            try:
                local.project_config_maps(config_maps)
            except PodConfigError:
                pass  # a ConfigMap deleted under a running pod: its files stay as they were

    async def release(self, pod_name: str) -> None:
        """Drop this kubelet's finalizer: the API server may now remove the pod."""
        pod = await self.kube.get("v1", "Pod", pod_name, self.namespace)
        if pod is None:
            return
        others = [f for f in pod["metadata"].get("finalizers") or [] if f != KUBELET_FINALIZER]
        await self.kube.merge_patch(
            "v1",
            "Pod",
            pod_name,
            self.namespace,
            {"metadata": {"finalizers": others or None}},
            missing_ok=True,
        )

    def _stop(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    def crash(self, pod_name: str) -> list[int]:
        """SIGKILL every live process of the pod's containers (an OOM kill, a crash); the
        containers then restart as usual. The processes killed."""
        local = next(p for p in self.pods.values() if p.name == pod_name)
        killed = local.live_processes()
        for pid in killed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def kill_everything(self) -> None:
        for local in self.pods.values():
            local.kill_all()

    def live_processes(self) -> dict[str, list[int]]:
        """Pod name -> processes still alive of all it ever started."""
        alive = {local.name: local.live_processes() for local in self.pods.values()}
        return {name: pids for name, pids in alive.items() if pids}

    def logs(self) -> dict[str, Path]:
        return {
            f"{local.name}/{path.stem}": path
            for local in self.pods.values()
            for path in sorted(local.dir.glob("*.log"))
        }
