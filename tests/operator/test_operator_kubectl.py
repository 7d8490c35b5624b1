"""The user's workflow with the built kubectl while the real operator runs, on the session's
control plane: the real Deployment controller reports readiness from the pods (bound to a Node
of the test's and reported running as a kubelet would), and the real garbage collector removes
the children with their PagedLLM."""

from __future__ import annotations

import re

import pytest

from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.operator_harness import (
    CRD_PATH,
    SAMPLES,
    Kube,
    Kubectl,
    bind,
    confirm_terminated,
    eventually,
    pods_path,
    report_running,
)

pytestmark = pytest.mark.usefixtures("operator_process")


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    return control_plane


def run_pods(kube: Kube, namespace: str, node: str) -> int:
    """Every pod of the namespace bound to `node` (where still unbound) and reported running
    and ready; how many pods there are."""
    pods = kube.list(pods_path(namespace))
    for index, pod in enumerate(pods):
        name = pod["metadata"]["name"]
        if not pod["spec"].get("nodeName"):
            bind(kube, namespace, name, node)
        if (pod.get("status") or {}).get("phase") != "Running":
            report_running(kube, namespace, name, ip=f"10.244.0.{index + 2}")
    return len(pods)


def test_apply_get_scale_wait_delete(
    kubectl: Kubectl, kube: Kube, namespace: str, node: str
) -> None:
    """apply the CRD and the demo, see its columns, scale it, wait for Ready once its pods run,
    patch it, have a bad patch refused, delete it and see its children go."""
    applied = kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH)).stdout
    assert "customresourcedefinition.apiextensions.k8s.io/pagedllms.pagedllm.io" in applied
    kubectl("wait", "--for=condition=Established", "crd/pagedllms.pagedllm.io", "--timeout=30s")
    assert (
        "pagedllm.pagedllm.io/demo created"
        in kubectl("apply", "-f", str(SAMPLES / "demo-cpu.yaml")).stdout
    )

    deployment = f"/apis/apps/v1/namespaces/{namespace}/deployments/demo"
    eventually(lambda: kube.get(deployment), timeout=15, what="the operator's Deployment")
    table = eventually(
        lambda: (out := kubectl("get", "pllm").stdout) and "http://" in out and out,
        what="the URL column",
    )
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "MODEL", "READY", "REPLICAS", "URL", "AGE"]
    assert row.split()[:5] == ["demo", "demo", "0", "1", f"http://demo.{namespace}.svc:80"]

    assert "scaled" in kubectl("scale", "pllm/demo", "--replicas=3").stdout
    eventually(
        lambda: kube.get(deployment)["spec"]["replicas"] == 3,
        what="the Deployment to follow kubectl scale",
    )

    # The ReplicaSets' pods, three serving and two routers, come up on the node: the
    # Deployment controller counts them ready, and the operator reports Ready.
    eventually(lambda: run_pods(kube, namespace, node) == 5, timeout=30, what="five pods running")
    kubectl("wait", "--for=condition=Ready", "pllm/demo", "--timeout=30s")
    ready = kubectl(
        "get", "deployments", "-o", "custom-columns=N:.metadata.name,R:.status.readyReplicas"
    )
    assert re.findall(r"^(\S+)\s+(\d+)$", ready.stdout, flags=re.M) == [
        ("demo", "3"),
        ("demo-router", "2"),
    ]

    kubectl("patch", "pllm", "demo", "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":8}}}')

    def max_num_seqs() -> str:
        args = kube.get(deployment)["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--max-num-seqs") + 1]

    eventually(lambda: max_num_seqs() == "8", what="the patched engine flag")

    rejected = kubectl(
        "patch",
        "pllm",
        "demo",
        "--type=merge",
        "-p",
        '{"spec":{"replicas":null,"autoscaling":{"minReplicas":3,"maxReplicas":2,"target":4}}}',
        check=False,
    )
    assert rejected.returncode != 0
    assert "minReplicas must not exceed maxReplicas" in rejected.stderr

    kubectl("delete", "pllm", "demo", "--timeout=30s")

    # The garbage collector follows the ownerReferences, in the background (and again should
    # the operator have written a child once more just before the delete): the Deployments,
    # then their ReplicaSets and pods, which the node's kubelet sees off.
    def left() -> str:
        confirm_terminated(kube, namespace)
        return kubectl("get", "deployments,replicasets,pods,services", "-o", "name").stdout

    eventually(lambda: left() == "", timeout=60, what="the children and their pods collected")
    assert "No resources found" in kubectl("get", "pllm").stderr
