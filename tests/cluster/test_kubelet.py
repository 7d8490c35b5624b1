"""The process kubelet (pagedllm_testing.cluster.kubelet) on the real control plane: it
registers its Node and keeps its Lease, runs a pod bound to it in a network namespace of its
own with the pod's ServiceAccount token where in-cluster clients read it (the apiserver then
knows the pod as its ServiceAccount), and stops it gracefully, removing its network."""

from __future__ import annotations

import ipaddress
import json
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedllm_testing.cluster import binary, network
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.cluster.image import BIN_DIR
from pagedllm_testing.cluster.kubelet import pod_network
from pagedllm_testing.cluster.kubelet.node import GPU, LEASE_NAMESPACE, NodeSpec
from pagedllm_testing.polling import eventually

# Only pods bound to the node by name run there: the taint keeps the scheduler from placing
# other tests' pods on it.
TAINT = "e2e.pagedllm.io/kubelet-test"

# Asks the apiserver who it is, through https://kubernetes.default.svc with the mounted token
# and CA, then serves HTTP on its pod's port 8080; on SIGTERM it writes a marker and exits.
POD_SCRIPT = textwrap.dedent(
    """
    import http.server, json, os, signal, ssl, sys, urllib.request
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    review = urllib.request.Request(
        "https://kubernetes.default.svc/apis/authentication.k8s.io/v1/selfsubjectreviews",
        data=json.dumps({"apiVersion": "authentication.k8s.io/v1",
                         "kind": "SelfSubjectReview"}).encode(),
        headers={"Authorization": "Bearer " + open(sa + "/token").read(),
                 "Content-Type": "application/json"},
    )
    context = ssl.create_default_context(cafile=sa + "/ca.crt")
    answer = json.load(urllib.request.urlopen(review, context=context))
    print("user", answer["status"]["userInfo"]["username"], flush=True)
    print("namespace", open(sa + "/namespace").read(), flush=True)
    print("pod ip", os.environ["POD_IP"], flush=True)

    def stop(*_):
        open(os.environ["MARKER"], "w").write("SIGTERM")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    http.server.ThreadingHTTPServer(
        ("", 8080), http.server.SimpleHTTPRequestHandler
    ).serve_forever()
    """
)


@pytest.fixture(scope="module")
def node(control_plane: ControlPlane) -> Iterator[str]:
    name = f"kubelet-test-{uuid.uuid4().hex[:6]}"
    control_plane.add_node(NodeSpec(name, 1, taints=(TAINT,)), bin_dirs=[str(BIN_DIR)])
    control_plane.wait_nodes_ready()
    yield name
    control_plane.remove_node(name)


@pytest.fixture
def namespace(control_plane: ControlPlane) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name)
    return name


def get(control_plane: ControlPlane, *args: str) -> dict[str, Any]:
    return json.loads(control_plane.kubectl("get", *args, "-o", "json").stdout)


def test_the_node_registers_ready_and_renews_its_lease(
    control_plane: ControlPlane, node: str
) -> None:
    body = get(control_plane, "node", node)
    status = body["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert status["allocatable"][GPU] == "1"
    assert status["nodeInfo"]["kubeletVersion"] == binary.kubernetes_version()
    assert {t["key"] for t in body["spec"]["taints"]} >= {GPU, TAINT}
    bridge = network.Bridge(control_plane.current.bridge)
    assert {"type": "InternalIP", "address": bridge.host_address} in status["addresses"]

    def renew_time() -> str:
        lease = get(control_plane, "lease", node, "-n", LEASE_NAMESPACE)
        return str(lease["spec"]["renewTime"])

    first = renew_time()
    eventually(lambda: renew_time() != first, timeout=20, what="the lease to be renewed")
    # Its Node and its Lease are written as the node itself, as the Node authorizer and
    # NodeRestriction see it.
    users = {
        e["user"]["username"]
        for e in control_plane.audit_events()
        if e.get("objectRef", {}).get("name") == node
        and (e["objectRef"].get("resource"), e["verb"])
        in {("nodes", "create"), ("leases", "patch")}
    }
    assert users == {f"system:node:{node}"}, users


def test_a_pod_runs_in_its_own_network_as_its_service_account(
    control_plane: ControlPlane, node: str, namespace: str, tmp_path: Path
) -> None:
    control_plane.kubectl("-n", namespace, "create", "serviceaccount", "prober")
    marker = tmp_path / "terminated"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {
            "nodeName": node,
            "serviceAccountName": "prober",
            "terminationGracePeriodSeconds": 10,
            "containers": [
                {
                    "name": "web",
                    "image": "python",
                    "command": ["python", "-c", POD_SCRIPT],
                    "env": [
                        {"name": "MARKER", "value": str(marker)},
                        {
                            "name": "POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                    ],
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"port": "http", "path": "/"}},
                }
            ],
        },
    }
    control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(pod))
    control_plane.kubectl(
        "-n", namespace, "wait", "--for=condition=Ready", "pod/web", "--timeout=60s"
    )
    status = get(control_plane, "-n", namespace, "pod", "web")["status"]
    address = status["podIP"]
    bridge = network.Bridge(control_plane.current.bridge)
    assert ipaddress.ip_address(address) in bridge.subnet
    assert address != bridge.host_address and status["hostIP"] == bridge.host_address
    assert httpx.get(f"http://{address}:8080/", timeout=5, trust_env=False).status_code == 200
    # No kubelet server answers `kubectl logs` here: the output is in the kubelet's file.
    lines = eventually(
        lambda: (text := pod_log(control_plane, namespace, "web")).count("\n") >= 3 and text,
        timeout=10,
        what="the pod's output",
    )
    assert f"user system:serviceaccount:{namespace}:prober" in lines
    assert f"namespace {namespace}" in lines
    assert f"pod ip {address}" in lines
    # The token is in the pod's mount namespace only.
    assert not Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists()

    network_of = pod_network.of_address(bridge, address)
    assert pod_network.processes_in(network_of.namespace_path)
    control_plane.kubectl("-n", namespace, "delete", "pod", "web", "--timeout=30s")
    assert marker.read_text() == "SIGTERM"
    assert network_of not in pod_network.leftovers(bridge)
    assert not pod_network.processes_in(network_of.namespace_path)


def pod_log(control_plane: ControlPlane, namespace: str, pod: str) -> str:
    path = control_plane.layout.root / "pods" / f"{namespace}_{pod}" / "web.log"
    return path.read_text() if path.exists() else ""
