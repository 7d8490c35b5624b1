"""One pod's containers run as local processes, and the Pod status they amount to, as a
kubelet and its container runtime would run them (see the package's docstring for what is
not emulated).

- The pod gets a network namespace with an address on the cluster's bridge (pod_network.py):
  its containers' processes run in it (`nsenter --net`), so they bind their own container
  ports, status.podIP is that address, and probes go to it. Its /etc/hosts (bind-mounted, as
  the kubelet manages it) names the apiserver's address for kubernetes.default.svc, standing
  in for cluster DNS and the `kubernetes` Service's ClusterIP; KUBERNETES_SERVICE_HOST/PORT
  name the same address and port.
- Each container runs the command and args of the pod spec with the pod spec's env, looked up
  on PATH with the given directories first (the project's virtual environment, where the
  image has `pagedllm`), in a process group of its own, logging to ROOT/POD/CONTAINER.log.
  Only the image's own ENV (manifests/Dockerfile) and PATH come from outside the pod spec, and
  KUBERNETES_SERVICE_HOST/PORT (the apiserver's address on the bridge) as the kubelet sets them.
- Volumes: emptyDirs (any medium) are directories under ROOT/POD; configMap, secret,
  downwardAPI and projected volumes (serviceAccountToken through the TokenRequest API, bound
  to the pod, as the ServiceAccount admission plugin's kube-api-access volume asks) are too,
  written before the containers start and configMaps refreshed in place while the pod runs.
  Volumes mounted under /var/run/secrets (the service-account token, the cluster CA, the
  namespace) are bind-mounted at their mountPath in the pod's own mount namespace (`unshare
  --mount`), so in-cluster clients find them where they look; any other mount path in an env
  value or an arg is rewritten to its directory, and a /tmp mount becomes TMPDIR.
- Env: plain values, secretKeyRef and configMapKeyRef (read from the API, `optional`
  honoured), fieldRef to metadata.name/namespace/uid, spec.nodeName,
  spec.serviceAccountName, status.podIP and status.hostIP, resourceFieldRef for CPU.
- Init containers run in order, each to success, before the containers start.
- Probes: httpGet and tcpSocket startup, readiness and liveness probes with their thresholds;
  startup and readiness probes at their periodSeconds but at most every `max_probe_period`
  seconds (fast CI), liveness probes at theirs. restartPolicy
  Always: a container that exits is started again after an exponential back-off, shown as
  CrashLoopBackOff with the last exit code.
- Deletion: the preStop exec hooks run, then SIGTERM goes to each container's main process
  (as a container runtime signals PID 1), and what is left of its process group when the
  grace period is over gets SIGKILL; the pod's network goes, and the pod object is deleted
  for good (grace period 0, the pod's uid as precondition).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import os
import shutil
import signal
import subprocess
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from pagedllm_testing.cluster.kubelet import pod_network
from pagedllm_testing.cluster.kubelet.api import ApiError
from pagedllm_testing.cluster.kubelet.node import now

if TYPE_CHECKING:
    from pagedllm_testing.cluster.kubelet.kubelet import Kubelet

DEFAULT_GRACE_SECONDS = 30
MAX_RESTART_BACKOFF = 20.0
POLL_SECONDS = 0.1
CONFIG_MAP_REFRESH_SECONDS = 2.0
# Mounted where they are (in the pod's mount namespace), not rewritten: in-cluster clients
# read these fixed paths.
BIND_MOUNTED = "/var/run/secrets"
TOKEN_SECONDS = 3607
KUBERNETES_NAMES = ("", ".default", ".default.svc", ".default.svc.cluster.local")
# Runs the container's command with the pod's bind mounts: `sh -c SCRIPT sh SRC DST ... --
# ARGV`; each `exec` keeps the process id, so the runtime's pid is the command's.
MOUNT_SCRIPT = (
    'while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 126; shift 2; done; shift; exec "$@"'
)


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


VOLUME_KINDS = ("emptyDir", "configMap", "secret", "downwardAPI", "projected")


def volume_dirs(pod_spec: Mapping[str, Any], pod_dir: Path) -> dict[str, Path]:
    dirs = {}
    for volume in pod_spec.get("volumes") or []:
        if not any(kind in volume for kind in VOLUME_KINDS):
            raise PodConfigError(
                f"volume {volume['name']}: only {', '.join(VOLUME_KINDS)} volumes run here"
            )
        dirs[volume["name"]] = pod_dir / "volumes" / volume["name"]
    return dirs


def keyed_files(
    source: Mapping[str, Any], obj: Mapping[str, Any] | None, what: str, *, secret: bool = False
) -> dict[str, str]:
    """What a configMap or secret volume (or projection) holds: relative path -> content (its
    keys, or its `items`); PodConfigError for an object or key that is missing and not
    optional."""
    name = source.get("name") or source.get("secretName") or ""
    optional = bool(source.get("optional"))
    if obj is None:
        if optional:
            return {}
        raise PodConfigError(f'{what} "{name}" not found')
    data = dict(obj.get("data") or {})
    if secret:
        data = {k: base64.b64decode(v).decode() for k, v in data.items()}
    items = source.get("items")
    if items is None:
        return data
    files = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise PodConfigError(f'{what} "{name}" key "{item["key"]}" not found')
        files[item["path"]] = data[item["key"]]
    return files


def project_files(directory: Path, files: Mapping[str, str]) -> None:
    """Make `directory` hold exactly `files`, each changed one replaced atomically (a reader
    sees the old content or the new one, never half of it)."""
    directory.mkdir(parents=True, exist_ok=True)
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


def is_bind_mounted(mount_path: str) -> bool:
    return mount_path == BIND_MOUNTED or mount_path.startswith(BIND_MOUNTED + "/")


def rewrite_path(text: str, mounts: Sequence[tuple[str, Path]]) -> str:
    """A path under a mount moved to the mount's directory (also in `--flag=PATH`); paths
    under bind-mounted volumes stay as they are."""
    if text.startswith("-") and "=" in text:
        flag, _, value = text.partition("=")
        return f"{flag}={rewrite_path(value, mounts)}"
    for mount_path, directory in mounts:
        if is_bind_mounted(mount_path):
            continue
        if text == mount_path or text.startswith(mount_path + "/"):
            return str(directory) + text[len(mount_path) :]
    return text


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
            status["containerID"] = f"process://{self.process.pid}"
        return status


def _terminated(code: int, started_at: str) -> dict[str, Any]:
    if code < 0:  # killed by a signal: a shell's exit code, as container runtimes report
        return {
            "exitCode": 128 - code,
            "signal": -code,
            "reason": "Error",
            "startedAt": started_at,
            "finishedAt": now(),
        }
    return {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "startedAt": started_at,
        "finishedAt": now(),
    }


class LocalPod:
    """One pod's containers as local processes, and the Pod status they amount to."""

    def __init__(self, kubelet: Kubelet, pod: dict[str, Any]):
        self.kubelet = kubelet
        meta = pod["metadata"]
        self.name, self.namespace, self.uid = meta["name"], meta["namespace"], meta["uid"]
        self.path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"
        self.spec = pod["spec"]
        self.dir = kubelet.root / "pods" / f"{self.namespace}_{self.name}"
        self.dirs: dict[str, Path] = {}
        self.network: pod_network.PodNetwork | None = None
        self.init_containers = [ContainerRun(c) for c in self.spec.get("initContainers") or []]
        self.containers = [ContainerRun(c) for c in self.spec.get("containers") or []]
        self.initialized = not self.init_containers
        self.created_at = now()
        self.process_groups: list[int] = []
        self.terminating = False
        self.finished = False
        self.task: asyncio.Task[None] | None = None
        self._published: dict[str, Any] | None = None
        self._publish_lock = asyncio.Lock()

    @property
    def ip(self) -> str:
        return self.network.address if self.network is not None else ""

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

        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": self.kubelet.host_address,
            "hostIPs": [{"ip": self.kubelet.host_address}],
            "startTime": self.created_at,
            "conditions": [
                condition("PodReadyToStartContainers", self.network is not None),
                condition("PodScheduled", True),
                condition("Initialized", self.initialized),
                condition("ContainersReady", ready),
                condition("Ready", ready),
            ],
            "initContainerStatuses": [c.status() for c in self.init_containers],
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.ip:
            status["podIP"], status["podIPs"] = self.ip, [{"ip": self.ip}]
        return status

    async def publish(self, *, api: bool = True) -> None:
        async with self._publish_lock:
            status = self.status()
            if status == self._published or not api:
                return
            await self.kubelet.api.merge_patch(
                f"{self.path}/status", {"metadata": {"uid": self.uid}, "status": status}
            )
            self._published = status

    # --- starting ----------------------------------------------------------------------------

    async def prepare(self) -> None:
        """The pod's network and volumes, before anything starts."""
        self.dirs = volume_dirs(self.spec, self.dir)
        for directory in [self.dir, *self.dirs.values()]:
            directory.mkdir(parents=True, exist_ok=True)
        await self.write_volumes()
        if self.network is None:
            address = pod_network.allocate(self.kubelet.ipam, self.kubelet.bridge, self.uid)
            self.network = address
            pod_network.create(address)

    def write_hosts(self) -> Path:
        """The pod's /etc/hosts, as the kubelet writes one: localhost, the pod's own name and,
        standing in for cluster DNS and the `kubernetes` Service, the apiserver's address."""
        hosts = self.dir / "etc-hosts"
        names = " ".join(f"kubernetes{suffix}" for suffix in KUBERNETES_NAMES)
        hosts.write_text(
            "# Kubernetes-managed hosts file (the process kubelet's).\n"
            "127.0.0.1\tlocalhost\n"
            "::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{self.ip}\t{self.name}\n"
            f"{self.kubelet.apiserver_host}\t{names}\n"
        )
        return hosts

    async def write_volumes(self, *, refresh: bool = False) -> None:
        """Every configMap, secret, downwardAPI and projected volume written (or, with
        ``refresh``, the configMap ones brought up to date)."""
        for volume in self.spec.get("volumes") or []:
            if "emptyDir" in volume or (refresh and "configMap" not in volume):
                continue
            sources = (volume.get("projected") or {}).get("sources") or [volume]
            files: dict[str, str] = {}
            for source in sources:
                files.update(await self._source_files(source))
            project_files(self.dirs[volume["name"]], files)

    async def _source_files(self, source: Mapping[str, Any]) -> dict[str, str]:
        if "configMap" in source:
            ref = source["configMap"]
            obj = await self._object("configmaps", ref["name"])
            return keyed_files(ref, obj, "configmap")
        if "secret" in source:
            ref = source["secret"]
            name = ref.get("secretName") or ref.get("name")
            return keyed_files(ref, await self._object("secrets", name), "secret", secret=True)
        if "downwardAPI" in source:
            items = source["downwardAPI"].get("items") or []
            return {item["path"]: self._field(item["fieldRef"]["fieldPath"]) for item in items}
        if "serviceAccountToken" in source:
            ref = source["serviceAccountToken"]
            return {ref["path"]: await self._token(ref)}
        raise PodConfigError(f"volume source {sorted(source)} is not emulated")

    async def _object(self, resource: str, name: str) -> dict[str, Any] | None:
        """A ConfigMap or Secret the pod names; a refusal (the Node authorizer learns of a
        pod's references a moment after the pod is bound) is retried with the pod."""
        path = f"/api/v1/namespaces/{self.namespace}/{resource}/{name}"
        try:
            return await self.kubelet.api.get(path)
        except (ApiError, httpx.HTTPError) as error:
            raise PodConfigError(f"{resource} {name}: {error}") from error

    async def _token(self, ref: Mapping[str, Any]) -> str:
        """A token of the pod's ServiceAccount bound to the pod (TokenRequest), as the kubelet
        gets it."""
        account = self.spec.get("serviceAccountName") or "default"
        spec: dict[str, Any] = {
            "expirationSeconds": int(ref.get("expirationSeconds", TOKEN_SECONDS)),
            "boundObjectRef": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": self.name,
                "uid": self.uid,
            },
        }
        if ref.get("audience"):
            spec["audiences"] = [ref["audience"]]
        path = f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token"
        try:
            answer = await self.kubelet.api.request(
                "POST",
                path,
                body={
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "TokenRequest",
                    "spec": spec,
                },
            )
        except ApiError as error:
            raise PodConfigError(f"token of serviceaccount {account}: {error}") from error
        assert answer is not None
        return str(answer["status"]["token"])

    def _field(self, path: str) -> str:
        values = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "spec.nodeName": self.kubelet.node.name,
            "spec.serviceAccountName": self.spec.get("serviceAccountName") or "default",
            "status.podIP": self.ip,
            "status.hostIP": self.kubelet.host_address,
        }
        if path not in values:
            raise PodConfigError(f"fieldRef {path} is not emulated")
        return values[path]

    async def _env(
        self, container: Mapping[str, Any], mounts: Sequence[tuple[str, Path]]
    ) -> dict[str, str]:
        env = {
            "PATH": self.kubelet.path_variable,
            "HOSTNAME": self.name,
            **self.kubelet.image_env,
            # The apiserver itself: no kube-proxy routes the `kubernetes` Service's ClusterIP.
            "KUBERNETES_SERVICE_HOST": self.kubelet.apiserver_host,
            "KUBERNETES_SERVICE_PORT": str(self.kubelet.apiserver_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(self.kubelet.apiserver_port),
        }
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
            try:
                return self._field(field_ref.get("fieldPath", ""))
            except PodConfigError as error:
                raise PodConfigError(f"env {name}: {error}") from None
        for kind, resource in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            ref = source.get(kind)
            if ref is None:
                continue
            obj = await self._object(resource, ref["name"])
            data = (obj or {}).get("data") or {}
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                what = "secret" if kind == "secretKeyRef" else "configmap"
                raise PodConfigError(f'{what} "{ref["name"]}" key "{ref["key"]}" not found')
            value = data[ref["key"]]
            return base64.b64decode(value).decode() if kind == "secretKeyRef" else value
        raise PodConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")

    def _spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        log: Path,
        mounts: Sequence[tuple[str, Path]],
    ) -> subprocess.Popen[bytes]:
        executable = shutil.which(argv[0], path=env["PATH"])
        if executable is None:
            raise FileNotFoundError(f'exec: "{argv[0]}": executable file not found in $PATH')
        assert self.network is not None
        binds = [str(self.write_hosts()), "/etc/hosts"]
        for path, directory in mounts:
            if is_bind_mounted(path):
                Path(path).mkdir(parents=True, exist_ok=True)  # the mount point, empty
                binds += [str(directory), path]
        wrapped = [
            "nsenter",
            f"--net={self.network.namespace_path}",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            MOUNT_SCRIPT,
            "sh",
            *binds,
            "--",
            executable,
            *argv[1:],
        ]
        with log.open("ab") as out:
            process = subprocess.Popen(
                wrapped,
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
        argv = [*command, *(rewrite_path(a, mounts) for a in spec.get("args") or [])]
        run.process = self._spawn(argv, run.env, self.log_path(run), mounts)
        run.started_at = now()
        run.waiting = None
        run.terminated = None
        run.started = run.ready = False

    # --- running ----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            self.dir.mkdir(parents=True, exist_ok=True)
            with (self.dir / "kubelet.log").open("a") as log:
                log.write(f"the kubelet failed on this pod:\n{traceback.format_exc()}")
            raise

    async def _run(self) -> None:
        # A missing ConfigMap or Secret (or the namespace's kube-root-ca.crt not published
        # yet) holds the pod in ContainerCreating, retried as the kubelet retries it.
        while True:
            try:
                await self.prepare()
                break
            except PodConfigError as error:
                for run in [*self.init_containers, *self.containers]:
                    run.waiting = ("CreateContainerConfigError", str(error))
                await self.publish()
                await asyncio.sleep(1.0)
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
                self._back_off(run, backoff)
                await self.publish()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_RESTART_BACKOFF)

    def _back_off(self, run: ContainerRun, backoff: float) -> None:
        run.restarts += 1
        run.waiting = (
            "CrashLoopBackOff",
            f"back-off {backoff:g}s restarting failed container={run.name} pod={self.name}",
        )

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
                run.ready = run.started = False
                self._back_off(run, backoff)
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
        liveness = run.spec.get("livenessProbe")
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
        failures = live_failures = 0
        next_liveness = time.monotonic() + float((liveness or {}).get("initialDelaySeconds", 0))
        while run.running:
            if readiness is None:
                run.ready = True
            elif await self._probe(run, readiness):
                run.ready, failures = True, 0
            else:
                failures += 1
                if failures >= readiness.get("failureThreshold", 3):
                    run.ready = False
            if liveness is not None and time.monotonic() >= next_liveness:
                # At its own period, not shortened: a restart is no test's shortcut.
                next_liveness = time.monotonic() + float(liveness.get("periodSeconds", 10))
                live_failures = 0 if await self._probe(run, liveness) else live_failures + 1
                if live_failures >= liveness.get("failureThreshold", 3):
                    _kill_group(run.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
            await self.publish()
            await self._sleep_while_running(
                run, self._period(readiness) if readiness else POLL_SECONDS * 5
            )
        await self.publish()

    def _probe_port(self, run: ContainerRun, port: int | str) -> int | None:
        if isinstance(port, str) and not port.isdigit():
            found = next(
                (p["containerPort"] for p in run.spec.get("ports") or [] if p.get("name") == port),
                None,
            )
            return int(found) if found is not None else None
        return int(port)

    async def _probe(self, run: ContainerRun, probe: Mapping[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            action = probe["httpGet"]
            port = self._probe_port(run, action["port"])
            if port is None:
                return False
            try:
                response = await self.kubelet.probes.get(
                    f"http://{self.ip}:{port}{action.get('path', '/')}", timeout=timeout
                )
            except httpx.HTTPError:
                return False
            return 200 <= response.status_code < 400
        if "tcpSocket" in probe:
            port = self._probe_port(run, probe["tcpSocket"]["port"])
            if port is None:
                return False
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(self.ip, port), timeout)
            except (OSError, asyncio.TimeoutError):
                return False
            writer.close()
            return True
        raise PodConfigError(f"container {run.name}: only httpGet and tcpSocket probes run here")

    # --- stopping ----------------------------------------------------------------------------

    async def terminate(self, grace: float, *, api: bool = True) -> None:
        """Graceful stop: preStop hooks, SIGTERM, SIGKILL after the grace period, the network
        removed, and (with `api`) the pod object deleted."""
        self.terminating = True
        deadline = time.monotonic() + grace
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        running = [c for c in [*self.init_containers, *self.containers] if c.running]
        with contextlib.suppress(ApiError, httpx.HTTPError):
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
        self.remove_network()
        if api:
            with contextlib.suppress(ApiError, httpx.HTTPError):
                await self.publish()
                await self.kubelet.api.delete_pod(self.namespace, self.name, self.uid)

    def remove_network(self) -> None:
        if self.network is not None:
            pod_network.delete(self.network, self.kubelet.ipam)
            self.network = None

    async def _pre_stop(self, run: ContainerRun, deadline: float) -> None:
        hook = ((run.spec.get("lifecycle") or {}).get("preStop") or {}).get("exec")
        if not hook:
            return
        mounts = mounts_of(run.spec, self.dirs)
        try:
            process = self._spawn(list(hook["command"]), run.env, self.log_path(run), mounts)
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
