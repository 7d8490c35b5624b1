"""The real control plane (pagedllm_testing.cluster): the pinned version on both sides of the
built kubectl, the apiserver's and etcd's metrics, RBAC with service-account tokens as the audit
log records them, the real controllers at work (a Deployment's ReplicaSet and pods, garbage
collection), components restarted alone, and nothing left behind by `down`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import httpx
import pytest

from pagedllm_testing.cluster import binary, network
from pagedllm_testing.cluster.control_plane import (
    ADMIN_USER,
    ControlPlane,
    is_running,
    kubeconfig_text,
)
from pagedllm_testing.cluster.kubelet import pod_network
from pagedllm_testing.polling import eventually


@pytest.fixture
def namespace(control_plane: ControlPlane) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name)
    return name


def test_kubectl_version_names_the_pinned_release_on_both_sides(
    control_plane: ControlPlane,
) -> None:
    versions = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    pinned = binary.kubernetes_version()
    assert versions["serverVersion"]["gitVersion"] == pinned
    assert versions["clientVersion"]["gitVersion"] == pinned
    assert pinned.startswith("v1.3")


def test_metrics_have_stored_objects_and_etcd_requests(control_plane: ControlPlane) -> None:
    metrics = control_plane.kubectl("get", "--raw", "/metrics").stdout
    assert 'apiserver_storage_objects{resource="namespaces"}' in metrics
    assert "etcd_request_duration_seconds_count{" in metrics
    # etcd's own endpoint: a leader, so writes go through.
    etcd = httpx.get(
        f"http://127.0.0.1:{control_plane.current.ports['etcd-metrics']}/metrics", timeout=10
    ).text
    assert "etcd_server_has_leader 1" in etcd


def test_the_audit_log_names_the_admin_and_service_accounts(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    k = control_plane.kubectl
    k("-n", namespace, "create", "serviceaccount", "reader")
    token = k("-n", namespace, "create", "token", "reader", "--duration=10m").stdout.strip()
    config = tmp_path / "reader.kubeconfig"
    config.write_text(
        kubeconfig_text(
            control_plane.server, control_plane.ca, "reader", token=token, namespace=namespace
        )
    )
    as_reader = {**os.environ, "KUBECONFIG": str(config)}
    denied = k("get", "configmaps", check=False, env=as_reader)
    assert denied.returncode != 0
    assert f"system:serviceaccount:{namespace}:reader" in denied.stderr
    assert "forbidden" in denied.stderr
    k("-n", namespace, "create", "role", "read", "--verb=list", "--resource=configmaps")
    k(
        "-n",
        namespace,
        "create",
        "rolebinding",
        "read",
        "--role=read",
        f"--serviceaccount={namespace}:reader",
    )
    eventually(
        lambda: k("get", "configmaps", check=False, env=as_reader).returncode == 0,
        what="the RoleBinding to take effect",
    )

    def lists_by(user: str) -> list[int]:
        return [
            e["responseStatus"]["code"]
            for e in control_plane.audit_events()
            if e["verb"] == "list"
            and e.get("objectRef", {}).get("resource") == "configmaps"
            and e.get("objectRef", {}).get("namespace") == namespace
            and e["user"]["username"] == user
        ]

    codes = lists_by(f"system:serviceaccount:{namespace}:reader")
    assert 403 in codes and 200 in codes
    created = [
        e
        for e in control_plane.audit_events()
        if e["verb"] == "create" and e.get("objectRef", {}).get("name") == namespace
    ]
    assert [e["user"]["username"] for e in created] == [ADMIN_USER]


def test_the_real_controllers_run_a_deployment_and_collect_its_garbage(
    control_plane: ControlPlane, namespace: str
) -> None:
    k = control_plane.kubectl
    k("-n", namespace, "create", "deployment", "web", "--image=example.invalid/web", "--replicas=2")

    def pods() -> list[dict]:
        return json.loads(k("-n", namespace, "get", "pods", "-o", "json").stdout)["items"]

    # The Deployment controller made a ReplicaSet, the ReplicaSet controller its two pods
    # (Pending: no node of this test has room), each owned by the ReplicaSet.
    found = eventually(lambda: len(pods()) == 2 and pods(), timeout=30, what="two pods")
    owners = {ref["kind"] for pod in found for ref in pod["metadata"]["ownerReferences"]}
    assert owners == {"ReplicaSet"}
    k(
        "-n",
        namespace,
        "delete",
        "deployment",
        "web",
        "--cascade=foreground",
        "--wait=true",
        "--timeout=60s",
    )
    eventually(lambda: pods() == [], timeout=30, what="the pods collected")
    replica_sets = json.loads(k("-n", namespace, "get", "replicasets", "-o", "json").stdout)
    assert replica_sets["items"] == []


def test_a_component_stops_and_starts_alone(control_plane: ControlPlane) -> None:
    control_plane.stop("kube-scheduler")
    assert not control_plane.running("kube-scheduler")
    assert control_plane.running("kube-apiserver")
    assert control_plane.kubectl("get", "--raw", "/readyz").stdout == "ok"
    control_plane.up()  # starts what is not running
    assert control_plane.running("kube-scheduler")

    control_plane.stop("kube-apiserver")
    assert control_plane.kubectl("get", "ns", check=False).returncode != 0
    control_plane.up()
    assert "default" in control_plane.kubectl("get", "ns").stdout


def cluster_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """What `make cluster` and `make cluster-down` run."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "pagedllm_testing.cluster", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_make_cluster_prints_a_kubeconfig_and_down_leaves_nothing() -> None:
    """`up` starts the control plane and a kubelet per node and waits for every Node to be
    Ready; `down`, from another process (the state file alone), leaves no process, pod network
    namespace, veth, bridge or mount."""
    # Short: a pod's folder is under it.
    root = Path(tempfile.mkdtemp(prefix="pllm-cli-")) / "cluster"
    up = cluster_cli("up", "--root", str(root), "--gpu-nodes", "1")
    assert up.returncode == 0, up.stderr
    (line,) = [x for x in up.stdout.splitlines() if x.startswith("KUBECONFIG=")]
    kubeconfig = line.removeprefix("KUBECONFIG=")
    assert Path(kubeconfig) == root / "kubeconfig"
    env = {**os.environ, "KUBECONFIG": kubeconfig}

    def kubectl(*args: str) -> str:
        result = subprocess.run(
            [binary.kubectl(), *args], capture_output=True, text=True, timeout=60, env=env
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    version = json.loads(kubectl("version", "-o", "json"))
    assert version["serverVersion"]["gitVersion"] == binary.kubernetes_version()
    nodes = json.loads(kubectl("get", "nodes", "-o", "json"))["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == ["gpu-0", "system-0"]
    assert all(
        any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
        for n in nodes
    )
    status = cluster_cli("status", "--root", str(root))
    assert status.stdout.count(": running") == 4 + 2, status.stdout
    # A pod, running in a network namespace of its own, for `down` to clean up after.
    kubectl("run", "sleeper", "--image=python", "--command", "--", "sleep", "600")
    kubectl("wait", "--for=jsonpath={.status.phase}=Running", "pod/sleeper", "--timeout=60s")

    # Another process stops it, from the state file alone.
    cluster = ControlPlane(root)
    state = cluster.current
    pids, bridge = list(state.pids.values()), network.Bridge(state.bridge)
    (pod_net,) = pod_network.leftovers(bridge)
    assert pod_network.processes_in(pod_net.namespace_path)
    assert network.bridge_exists(bridge)
    down = cluster_cli("down", "--root", str(root))
    assert down.returncode == 0, down.stderr
    # Gone, or at most a zombie until init (their parent since `up` exited) reaps it.
    eventually(lambda: not [pid for pid in pids if is_running(pid)], what="no process left")
    assert not network.bridge_exists(bridge)
    assert not pod_network.leftovers(bridge)
    links = network.ip("-o", "link").stdout
    assert pod_net.veth not in links and bridge.name not in links
    assert str(root) not in Path("/proc/self/mountinfo").read_text()
    assert cluster_cli("status", "--root", str(root)).returncode == 1
    shutil.rmtree(root.parent)
