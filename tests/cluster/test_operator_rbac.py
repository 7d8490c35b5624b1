"""The real operator against the real apiserver, logged in as its own ServiceAccount with the
RBAC of manifests/ (a token from the TokenRequest API, as a kubelet mounts it): it reconciles a
PagedLLM into its children, which the garbage collector removes with it; every request it makes
is attributed to the ServiceAccount in the audit log; and a verb taken from its ClusterRole
surfaces as a condition and an Event on the PagedLLM instead of a silent stall."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedllm.operator.children import router_name, serving_service_name
from pagedllm.operator.kube import FIELD_MANAGER
from pagedllm_testing.cluster.control_plane import ControlPlane, kubeconfig_text
from pagedllm_testing.cluster.kubelet.node import now
from pagedllm_testing.operator_harness import SAMPLES, OperatorProcess
from pagedllm_testing.polling import eventually

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "pagedllm-system"
OPERATOR_USER = f"system:serviceaccount:{SYSTEM}:pagedllm-operator"
# As manifests/operator.yaml runs it: `pagedllm operator --all-namespaces`.
OPERATOR_COMMAND = [str(Path(sys.executable).parent / "pagedllm"), "operator", "--all-namespaces"]
CHILDREN = (
    "deployment/demo",
    "service/demo",
    f"service/{serving_service_name('demo')}",
    f"deployment/{router_name('demo')}",
)


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane) -> ControlPlane:
    """`kubectl apply -k manifests/` (CRD, namespace, RBAC, the operator's Deployment), the
    Deployment scaled to zero: these tests run the operator as a local process instead."""
    control_plane.kubectl("apply", "--server-side", "-k", str(REPO / "manifests"))
    control_plane.kubectl(
        "wait", "--for=condition=Established", "crd/pagedllms.pagedllm.io", "--timeout=60s"
    )
    control_plane.kubectl("-n", SYSTEM, "scale", "deployment/pagedllm-operator", "--replicas=0")
    return control_plane


@pytest.fixture(scope="module")
def operator_since(installed: ControlPlane) -> str:
    """When this module's operator starts: the session's cluster has run others before (as the
    admin, in tests/operator), whose requests the audit log also holds."""
    return now(micro=True)


@pytest.fixture(scope="module")
def operator(
    installed: ControlPlane, operator_since: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    workdir = tmp_path_factory.mktemp("operator")
    token = installed.kubectl(
        "-n", SYSTEM, "create", "token", "pagedllm-operator", "--duration=1h"
    ).stdout.strip()
    config = workdir / "kubeconfig"
    config.write_text(
        kubeconfig_text(installed.server, installed.ca, "pagedllm-operator", token=token)
    )
    process = OperatorProcess(config, workdir, OPERATOR_COMMAND)
    process.start()
    yield process
    if process.process is not None:
        process.stop()


def apply_demo(cluster: ControlPlane, namespace: str) -> None:
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("-n", namespace, "apply", "-f", str(SAMPLES / "demo-cpu.yaml"))


def get(cluster: ControlPlane, namespace: str, what: str) -> dict[str, Any] | None:
    result = cluster.kubectl("-n", namespace, "get", what, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def test_the_operator_reconciles_as_its_service_account(
    installed: ControlPlane, operator: OperatorProcess, operator_since: str
) -> None:
    namespace = f"op-{uuid.uuid4().hex[:8]}"
    apply_demo(installed, namespace)
    for child in CHILDREN:
        eventually(
            lambda child=child: get(installed, namespace, child),
            timeout=60,
            what=f"the operator's {child}",
        )
    deployment = get(installed, namespace, "deployment/demo")
    assert deployment is not None
    (owner,) = deployment["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("PagedLLM", "demo")
    # The real Deployment controller took it from there: a ReplicaSet of the operator's pods.
    eventually(
        lambda: (rs := get(installed, namespace, "replicasets")) and rs["items"],
        timeout=30,
        what="the Deployment controller's ReplicaSet",
    )
    status = eventually(
        lambda: ((get(installed, namespace, "pllm/demo") or {}).get("status") or {}).get(
            "conditions"
        ),
        timeout=60,
        what="the PagedLLM's status conditions",
    )
    assert {c["type"] for c in status} >= {"Ready"}

    # Every request from the operator's process, kopf's watches and its own client alike
    # (their User-Agents), is the ServiceAccount's, none the admin's.
    def operator_requests() -> list[dict[str, Any]]:
        return [
            e
            for e in installed.audit_events()
            if e["userAgent"].startswith(("kopf/", FIELD_MANAGER))
            and e["requestReceivedTimestamp"] >= operator_since
        ]

    found = eventually(
        lambda: (
            {e["userAgent"].split("/")[0] for e in operator_requests()} >= {"kopf", FIELD_MANAGER}
            and operator_requests()
        ),
        what="kopf's and the operator client's requests in the audit log",
    )
    assert {e["user"]["username"] for e in found} == {OPERATOR_USER}
    applied = [
        e
        for e in found
        if e["verb"] == "patch" and e.get("objectRef", {}).get("namespace") == namespace
    ]
    assert {e["objectRef"]["resource"] for e in applied} >= {"deployments", "services"}

    # Deleting the PagedLLM leaves nothing: the real garbage collector follows the owner
    # references to every child, and from the Deployments to their ReplicaSets and pods.
    installed.kubectl("-n", namespace, "delete", "pllm/demo", "--wait=true", "--timeout=60s")

    def left() -> list[str]:
        kinds = "deployments,replicasets,pods,services,poddisruptionbudgets,configmaps"
        listed = installed.kubectl("-n", namespace, "get", kinds, "-o", "name").stdout.split()
        # Every namespace has the cluster's root CA, published by kube-controller-manager.
        return [name for name in listed if name != "configmap/kube-root-ca.crt"]

    eventually(lambda: left() == [], timeout=60, what="no child and no pod left")


def test_a_verb_taken_from_the_operator_surfaces_as_an_event(
    installed: ControlPlane, operator: OperatorProcess
) -> None:
    role = get(installed, "default", "clusterrole/pagedllm-operator")
    assert role is not None
    # `patch` on Services taken away: server-side apply of the demo's Service is refused.
    cut = json.loads(json.dumps(role))
    for rule in cut["rules"]:
        if rule.get("resources") == ["services"]:
            rule["verbs"].remove("patch")
    for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        cut["metadata"].pop(key, None)
    installed.kubectl("replace", "-f", "-", stdin=json.dumps(cut))
    namespace = f"op-{uuid.uuid4().hex[:8]}"
    try:
        apply_demo(installed, namespace)

        def warnings() -> list[str]:
            events = get(installed, namespace, "events") or {"items": []}
            return [
                e["message"]
                for e in events["items"]
                if e["involvedObject"]["kind"] == "PagedLLM" and e["type"] == "Warning"
            ]

        found = eventually(
            lambda: [m for m in warnings() if 'cannot patch resource "services"' in m],
            timeout=60,
            what="a Warning Event naming the forbidden request",
        )
        assert OPERATOR_USER in found[0]
        status = (get(installed, namespace, "pllm/demo") or {}).get("status") or {}
        degraded = [c for c in status.get("conditions", []) if c["type"] == "Degraded"]
        assert [(c["status"], c["reason"]) for c in degraded] == [("True", "Forbidden")]
    finally:
        original = {k: v for k, v in role.items()}
        original["metadata"] = {"name": "pagedllm-operator"}
        installed.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", "-", stdin=yaml.safe_dump(original)
        )
