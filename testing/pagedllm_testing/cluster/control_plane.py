"""A real Kubernetes control plane on this machine: etcd, kube-apiserver, kube-controller-manager
and kube-scheduler from Kubernetes' own Go modules (binary.py), each a process of its own with
the flags a kubeadm cluster gives it, TLS everywhere, RBAC on, service-account tokens signed by a
key of the cluster's, and an audit log. `make cluster` and the tests' session fixture both start
it through `ControlPlane`; its state (pids, ports) lives in a file, so that another process
(`make cluster-down`) can stop what one started.

etcd and the other components' health ports listen on loopback; the apiserver listens on, and
advertises, the host's address on the cluster's bridge (network.py), port 443, where the host's
clients and the pods reach it. The service range is never dialed: nothing routes it here, so
Services are reached through the apiserver's service proxy or the tests' own proxy
(service_proxy.py), and the pods' /etc/hosts name the apiserver's address for
kubernetes.default.svc."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from pagedllm_testing.cluster import binary, network, pki
from pagedllm_testing.cluster.kubelet import pod_network
from pagedllm_testing.cluster.kubelet.node import NodeSpec
from pagedllm_testing.cluster.kubelet.pods import BIND_MOUNTED
from pagedllm_testing.serve_harness import free_port

LOOPBACK = "127.0.0.1"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN_USER = "pagedllm-admin"
APISERVER_PORT = 443
# Start order: each needs the one before it.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
# Every request at Metadata level (who, what, which verb and object, the response code); the
# tests attribute requests to users from it.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata"}],
}
# Short periods, so that tests do not wait on the defaults meant for big clusters.
CONTROLLER_MANAGER_TIMERS = (
    "--horizontal-pod-autoscaler-sync-period=2s",
    "--horizontal-pod-autoscaler-downscale-stabilization=10s",
    "--node-monitor-period=2s",
    "--node-monitor-grace-period=20s",
    "--endpointslice-updates-batch-period=0s",
)


class ControlPlaneError(RuntimeError):
    pass


@dataclass(frozen=True)
class Layout:
    """Where a control plane keeps its files: ``root/{pki,logs,etcd}``, the admin kubeconfig
    at ``root/kubeconfig`` and the running state at ``root/state.json``; the binary in
    ``bin``, shared by every control plane of the checkout (built once)."""

    root: Path
    bin: Path = binary.BIN_DIR

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def audit_log(self) -> Path:
        return self.logs / "audit.log"

    def component_kubeconfig(self, component: str) -> Path:
        return self.pki / f"{component}.kubeconfig"


@dataclass
class State:
    """What `down` needs from the process that ran `up`: the ports, the bridge (whose host
    address the apiserver advertises) and every component's process (group) id."""

    ports: dict[str, int]
    bridge: int
    pids: dict[str, int] = field(default_factory=dict)
    # Node name -> its NodeSpec (kubelet/node.py) as JSON; its kubelet's pid is "kubelet/NAME".
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def advertise_address(self) -> str:
        return network.Bridge(self.bridge).host_address

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> State:
        return cls(**json.loads(path.read_text()))


def kubeconfig_text(
    server: str,
    ca: Path,
    user: str,
    *,
    client: pki.Pair | None = None,
    token: str | None = None,
    namespace: str = "default",
) -> str:
    """A kubeconfig of one cluster, one user (a client certificate or a bearer token) and one
    context, files referenced by absolute path."""
    credentials: dict[str, str] = {}
    if client is not None:
        credentials = {
            "client-certificate": str(client.cert),
            "client-key": str(client.key),
        }
    if token is not None:
        credentials["token"] = token
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "pagedllm", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [
            {
                "name": "pagedllm",
                "context": {"cluster": "pagedllm", "user": user, "namespace": namespace},
            }
        ],
        "current-context": "pagedllm",
    }
    return yaml.safe_dump(config, sort_keys=False)


def etcd_args(layout: Layout, ports: dict[str, int]) -> list[str]:
    client = f"http://{LOOPBACK}:{ports['etcd']}"
    peer = f"http://{LOOPBACK}:{ports['etcd-peer']}"
    return [
        "--name=default",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        f"--listen-metrics-urls=http://{LOOPBACK}:{ports['etcd-metrics']}",
        # A test cluster is thrown away, never recovered: no fsync on every write.
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def apiserver_args(layout: Layout, ports: dict[str, int], advertise_address: str) -> list[str]:
    p = layout.pki
    return [
        f"--etcd-servers=http://{LOOPBACK}:{ports['etcd']}",
        # The host's address on the cluster's bridge, port 443: where the `kubernetes` Service
        # points and where in-cluster clients (kopf's among them) dial it, as
        # https://kubernetes.default.svc (the pods' /etc/hosts name it, see kubelet/pods.py).
        f"--bind-address={advertise_address}",
        f"--secure-port={ports['kube-apiserver']}",
        f"--advertise-address={advertise_address}",
        f"--tls-cert-file={p / 'apiserver.crt'}",
        f"--tls-private-key-file={p / 'apiserver.key'}",
        f"--client-ca-file={p / 'ca.crt'}",
        "--authorization-mode=Node,RBAC",
        # As kubeadm enables it: a kubelet may change only its own Node and its pods' status.
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={p / 'sa.pub'}",
        f"--service-account-signing-key-file={p / 'sa.key'}",
        # The aggregation layer (a custom-metrics APIService), reached at its pods' addresses.
        "--enable-aggregator-routing=true",
        f"--requestheader-client-ca-file={p / 'front-proxy-ca.crt'}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={p / 'front-proxy-client.crt'}",
        f"--proxy-client-key-file={p / 'front-proxy-client.key'}",
        f"--audit-policy-file={layout.root / 'audit-policy.yaml'}",
        f"--audit-log-path={layout.audit_log}",
        "--audit-log-format=json",
        # Written as requests finish, not batched, so a test reads its own requests at once.
        "--audit-log-mode=blocking",
        # apiserver_storage_objects, which dashboards and alerts still query, is deprecated
        # for apiserver_resource_objects and hidden from 1.37; this shows it for one more release.
        "--show-hidden-metrics-for-version=1.36",
    ]


def controller_manager_args(layout: Layout, ports: dict[str, int]) -> list[str]:
    p = layout.pki
    config = layout.component_kubeconfig("kube-controller-manager")
    return [
        f"--kubeconfig={config}",
        f"--authentication-kubeconfig={config}",
        f"--authorization-kubeconfig={config}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={ports['kube-controller-manager']}",
        f"--tls-cert-file={p / 'kube-controller-manager-serving.crt'}",
        f"--tls-private-key-file={p / 'kube-controller-manager-serving.key'}",
        f"--client-ca-file={p / 'ca.crt'}",
        "--leader-elect=false",
        # Each controller with a service account of its own, as kubeadm runs them.
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={p / 'sa.key'}",
        f"--root-ca-file={p / 'ca.crt'}",
        f"--cluster-signing-cert-file={p / 'ca.crt'}",
        f"--cluster-signing-key-file={p / 'ca.key'}",
        "--controllers=*",
        *CONTROLLER_MANAGER_TIMERS,
    ]


def scheduler_args(layout: Layout, ports: dict[str, int]) -> list[str]:
    p = layout.pki
    config = layout.component_kubeconfig("kube-scheduler")
    return [
        f"--kubeconfig={config}",
        f"--authentication-kubeconfig={config}",
        f"--authorization-kubeconfig={config}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={ports['kube-scheduler']}",
        f"--tls-cert-file={p / 'kube-scheduler-serving.crt'}",
        f"--tls-private-key-file={p / 'kube-scheduler-serving.key'}",
        "--leader-elect=false",
    ]


class ControlPlane:
    """One control plane under ``layout.root``. `up` starts what is not running and waits until
    the apiserver is ready; `stop`/`start` one component; `down` ends every process."""

    def __init__(self, root: Path, components: tuple[str, ...] = COMPONENTS):
        unknown = set(components) - set(COMPONENTS)
        if unknown or components[:2] != COMPONENTS[:2]:
            raise ControlPlaneError(
                f"components {components}: etcd and kube-apiserver first, then any of {COMPONENTS}"
            )
        self.layout = Layout(root.resolve())
        # ("etcd", "kube-apiserver") alone is envtest's cluster: objects are stored, validated
        # and watched, and no controller acts on them (tests set status themselves).
        self.components = components
        self.state: State | None = None

    # --- addresses and credentials -------------------------------------------------------

    @property
    def server(self) -> str:
        state = self._state()
        return f"https://{state.advertise_address}:{state.ports['kube-apiserver']}"

    @property
    def ca(self) -> Path:
        return self.layout.pki / "ca.crt"

    @property
    def admin(self) -> pki.Pair:
        return pki.Pair(self.layout.pki / "admin.crt", self.layout.pki / "admin.key")

    def ssl_context(self, client: pki.Pair | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        if client is not None:
            context.load_cert_chain(str(client.cert), str(client.key))
        return context

    def admin_client_options(self) -> dict[str, Any]:
        """httpx client options for the apiserver as the admin user."""
        return {
            "base_url": self.server,
            "verify": self.ssl_context(self.admin),
            "timeout": 10,
            "trust_env": False,
        }

    def kubectl_env(self) -> dict[str, str]:
        """The environment to run the built kubectl in as the admin user."""
        path = f"{self.layout.bin}{os.pathsep}{os.environ.get('PATH', '')}"
        return {
            **os.environ,
            "KUBECONFIG": str(self.layout.kubeconfig),
            "KUBECACHEDIR": str(self.layout.root / "kubectl-cache"),
            "PATH": path,
        }

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """The built kubectl, as the admin user unless ``env`` names another KUBECONFIG."""
        result = subprocess.run(
            [str(self.layout.bin / "kubectl"), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env or self.kubectl_env(),
            timeout=120,
        )
        if check and result.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def current(self) -> State:
        """The running cluster's state (ports, bridge, processes, nodes)."""
        return self._state()

    def _state(self) -> State:
        if self.state is None:
            if not self.layout.state.exists():
                raise ControlPlaneError(f"no control plane under {self.layout.root}")
            self.state = State.load(self.layout.state)
        return self.state

    def up(self, timeout: float = 180.0) -> None:
        layout = self.layout
        for directory in (layout.root, layout.pki, layout.logs):
            directory.mkdir(parents=True, exist_ok=True)
        binary.build(layout.bin)
        if layout.state.exists():
            self.state = State.load(layout.state)
        else:
            ports = {name: free_port() for name in (*COMPONENTS, "etcd-peer", "etcd-metrics")}
            ports["kube-apiserver"] = APISERVER_PORT  # on the bridge's address, the cluster's own
            self.state = State(ports=ports, bridge=network.create_bridge().index)
            self._state().save(layout.state)
            self._write_files()
        for name in self.components:
            if not self.running(name):
                self.start(name)
            self._wait_ready(name, timeout)
        self._state().save(layout.state)

    def _write_files(self) -> None:
        layout, state = self.layout, self._state()
        d = layout.pki
        ca = pki.make_ca(d, "ca", "pagedllm-cluster-ca")
        front_proxy = pki.make_ca(d, "front-proxy-ca", "pagedllm-front-proxy-ca")
        addresses = tuple(dict.fromkeys([LOOPBACK, state.advertise_address, "10.96.0.1"]))
        pki.issue(
            ca,
            d,
            "apiserver",
            "kube-apiserver",
            server_names=pki.APISERVER_DNS,
            server_addresses=addresses,
            client=False,
        )
        pki.issue(front_proxy, d, "front-proxy-client", "front-proxy-client")
        pki.service_account_keys(d)
        admin = pki.issue(ca, d, "admin", ADMIN_USER, organization="system:masters")
        for component in ("kube-controller-manager", "kube-scheduler"):
            client = pki.issue(ca, d, component, f"system:{component}")
            pki.issue(
                ca,
                d,
                f"{component}-serving",
                component,
                server_names=("localhost",),
                server_addresses=(LOOPBACK,),
                client=False,
            )
            layout.component_kubeconfig(component).write_text(
                kubeconfig_text(self.server, ca.cert, f"system:{component}", client=client)
            )
        layout.kubeconfig.write_text(
            kubeconfig_text(self.server, ca.cert, ADMIN_USER, client=admin)
        )
        layout.kubeconfig.chmod(0o600)
        (layout.root / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))

    def args(self, name: str) -> list[str]:
        layout, state = self.layout, self._state()
        if name == "etcd":
            return etcd_args(layout, state.ports)
        if name == "kube-apiserver":
            return apiserver_args(layout, state.ports, state.advertise_address)
        if name == "kube-controller-manager":
            return controller_manager_args(layout, state.ports)
        if name == "kube-scheduler":
            return scheduler_args(layout, state.ports)
        raise ControlPlaneError(f"no component {name!r}; the components are {COMPONENTS}")

    def start(self, name: str) -> None:
        argv = [str(self.layout.bin / name), *self.args(name)]
        log = (self.layout.logs / f"{name}.log").open("ab")
        # A session (and process group) of its own: `down` from another process ends it whole,
        # and a Ctrl-C in the terminal that ran `make cluster` does not.
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
        log.close()
        self._state().pids[name] = process.pid
        self._state().save(self.layout.state)

    def running(self, name: str) -> bool:
        pid = self._state().pids.get(name)
        return pid is not None and is_running(pid)

    def stop(self, name: str, grace: float = 10.0) -> None:
        pid = self._state().pids.pop(name, None)
        if pid is not None:
            _end_group(pid, grace)
        self._state().save(self.layout.state)

    # --- nodes --------------------------------------------------------------------------

    def add_node(
        self,
        node: NodeSpec,
        *,
        image_env: Mapping[str, str] | None = None,
        bin_dirs: Sequence[str] = (),
    ) -> None:
        """Start the node's kubelet (kubelet/, a process of its own); `wait_nodes_ready` waits
        for it to register."""
        argv = [sys.executable, "-P", "-m", "pagedllm_testing.cluster.kubelet"]
        argv += ["--cluster", str(self.layout.root), "--node", node.name, "--gpus", str(node.gpus)]
        argv += [f"--label={key}={value}" for key, value in node.labels.items()]
        argv += [f"--taint={key}" for key in node.taints]
        argv += [f"--env={key}={value}" for key, value in (image_env or {}).items()]
        argv += [f"--bin-dir={directory}" for directory in bin_dirs]
        log = (self.layout.logs / f"kubelet-{node.name}.log").open("ab")
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            cwd=self.layout.root,
        )
        log.close()
        state = self._state()
        state.pids[f"kubelet/{node.name}"] = process.pid
        state.nodes[node.name] = node.to_json()
        state.save(self.layout.state)

    def nodes(self) -> list[NodeSpec]:
        return [NodeSpec.from_json(data) for data in self._state().nodes.values()]

    def remove_node(self, name: str) -> None:
        """The node's kubelet stopped (its pods' processes killed, as on a lost machine) and
        its Node object deleted."""
        self.stop(f"kubelet/{name}", grace=30.0)
        self._state().nodes.pop(name, None)
        self._state().save(self.layout.state)
        self.kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")

    def wait_nodes_ready(self, timeout: float = 60.0) -> None:
        """Until every node's kubelet has registered it and it is Ready."""
        wanted = set(self._state().nodes)
        deadline = time.monotonic() + timeout
        ready: set[str] = set()
        while time.monotonic() < deadline:
            for name in wanted:
                if not self.running(f"kubelet/{name}"):
                    raise ControlPlaneError(
                        f"the kubelet of node {name} exited; its log:\n"
                        + self.log_tail(f"kubelet-{name}")
                    )
            listed = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]
            ready = {
                node["metadata"]["name"]
                for node in listed
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in (node.get("status") or {}).get("conditions") or []
                )
            }
            if wanted <= ready:
                return
            time.sleep(0.5)
        raise ControlPlaneError(f"nodes not Ready within {timeout:g}s: {sorted(wanted - ready)}")

    def down(self) -> None:
        """Every kubelet stopped (and whatever its pods left: processes, network namespaces,
        veths), then every component, in reverse order; the files stay (logs, certificates)."""
        if not self.layout.state.exists():
            return
        state = self._state()
        for name in list(state.nodes):
            self.stop(f"kubelet/{name}", grace=30.0)
            state.nodes.pop(name)
        bridge = network.Bridge(state.bridge)
        pod_network.sweep(bridge, self.layout.root / "ipam")
        remove_mount_points()
        for name in reversed(COMPONENTS):
            self.stop(name)
        network.delete_bridge(bridge)
        self.layout.state.unlink()
        self.state = None

    # --- readiness ----------------------------------------------------------------------

    def _health_url(self, name: str) -> str:
        ports = self._state().ports
        if name == "etcd":
            return f"http://{LOOPBACK}:{ports['etcd-metrics']}/health"
        if name == "kube-apiserver":
            return f"{self.server}/readyz"
        return f"https://{LOOPBACK}:{ports[name]}/healthz"

    def _wait_ready(self, name: str, timeout: float) -> None:
        url = self._health_url(name)
        verify: ssl.SSLContext | bool = (
            self.ssl_context(self.admin) if url.startswith("https") else False
        )
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if not self.running(name):
                raise ControlPlaneError(
                    f"{name} exited while starting; its log:\n{self.log_tail(name)}"
                )
            try:
                response = httpx.get(url, verify=verify, timeout=5.0)
                if response.status_code == 200:
                    return
                last = f"{response.status_code} {response.text[-500:]}"
            except httpx.HTTPError as error:
                last = repr(error)
            time.sleep(0.25)
        raise ControlPlaneError(
            f"{name} not ready within {timeout:g}s ({url}: {last}); its log:\n{self.log_tail(name)}"
        )

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.layout.logs / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # --- the audit log ------------------------------------------------------------------

    def audit_events(self) -> list[dict[str, Any]]:
        """Every audit event so far (one JSON object a line)."""
        if not self.layout.audit_log.exists():
            return []
        return [json.loads(line) for line in self.layout.audit_log.read_text().splitlines() if line]


def remove_mount_points() -> None:
    """The empty folders the kubelets made as mount points for the pods' service-account
    volumes (under /var/run/secrets), once no cluster of this machine has a pod left: removing
    a mount point detaches what other mount namespaces mounted there. One that holds anything
    stays."""
    if pod_network.any_pod_network():
        return
    path = Path(BIND_MOUNTED) / "kubernetes.io" / "serviceaccount"
    while path != Path(BIND_MOUNTED).parent:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


def is_running(pid: int) -> bool:
    """Whether process `pid` exists and is no zombie (ours is reaped on the way)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of ours still answers kill(0): reap it if it is our child.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return _not_zombie(pid)
    return done == 0


def _not_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _end_group(pgid: int, grace: float) -> None:
    """SIGTERM to the process group, SIGKILL once ``grace`` seconds have passed."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not is_running(pgid):
                return
            time.sleep(0.1)
