"""The real operator runs the routers: their children appear, follow the spec, go away when
spec.router.enabled turns false, and their readiness shows in the Router condition."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm_testing.operator_harness import (
    Kube,
    condition,
    deployment_path,
    eventually,
    mark_deployment_ready,
    pagedllm,
    pdb_path,
    pllm_path,
    service_path,
    wait_for_condition,
)

pytestmark = pytest.mark.usefixtures("crd", "operator_process")


def rbac_path(namespace: str, kind: str, name: str) -> str:
    return f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/{kind}/{name}"


def account_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}"


def router_children(kube: Kube, namespace: str) -> dict[str, dict[str, Any] | None]:
    return {
        "deployment": kube.get(deployment_path(namespace, "demo-router")),
        "pdb": kube.get(pdb_path(namespace, "demo-router")),
        "serving": kube.get(service_path(namespace, "demo-serving")),
        "account": kube.get(account_path(namespace, "demo-router")),
        "role": kube.get(rbac_path(namespace, "roles", "demo-router")),
        "binding": kube.get(rbac_path(namespace, "rolebindings", "demo-router")),
    }


def router_condition(kube: Kube, namespace: str) -> dict[str, Any]:
    return condition(kube.get(pllm_path(namespace, "demo")), "Router")


def test_routers_come_and_go_with_the_spec(kube: Kube, namespace: str) -> None:
    """The routers' children appear owned, the Service moves to the routers once one is ready
    and stays there, a child deleted by hand comes back, and with the router disabled they
    go and the Service selects the serving pods again."""
    created = kube.create(
        pllm_path(namespace),
        pagedllm("demo", {"model": {"servedName": "demo"}, "replicas": 2}),
    )
    children = eventually(
        lambda: (found := router_children(kube, namespace)) and all(found.values()) and found,
        what="the router's children",
    )
    for child in children.values():
        assert child is not None
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == created["metadata"]["uid"] and owner["controller"]
    routers = children["deployment"]
    assert routers is not None
    args = routers["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--discover-service") + 1] == "demo-serving"
    assert args[args.index("--discover-namespace") + 1] == namespace
    serving = kube.get(deployment_path(namespace, "demo"))["spec"]["selector"]["matchLabels"]
    router_labels = routers["spec"]["selector"]["matchLabels"]

    def service_selector() -> dict[str, str]:
        return kube.get(service_path(namespace, "demo"))["spec"]["selector"]

    # No router ready yet: clients still reach the serving pods directly.
    assert service_selector() == serving
    assert children["binding"]["subjects"] == [  # type: ignore[index]
        {"kind": "ServiceAccount", "name": "demo-router", "namespace": namespace}
    ]

    not_ready = eventually(lambda: router_condition(kube, namespace), what="a Router condition")
    assert (not_ready["status"], not_ready["reason"]) == ("False", "RoutersNotReady")
    assert not_ready["message"] == "0/2 routers ready"
    mark_deployment_ready(kube, namespace, "demo", ready=2)
    assert condition(kube.get(pllm_path(namespace, "demo")), "Ready")["status"] == "False"
    mark_deployment_ready(kube, namespace, "demo-router", ready=2)
    eventually(
        lambda: (
            router_condition(kube, namespace).get("status") == "True"
            and condition(kube.get(pllm_path(namespace, "demo")), "Ready").get("status") == "True"
        ),
        what="Router and Ready",
    )
    eventually(lambda: service_selector() == router_labels, what="the Service on the routers")
    # From then on it stays there, even while no router is ready (no flapping).
    mark_deployment_ready(kube, namespace, "demo-router", ready=0)
    eventually(
        lambda: router_condition(kube, namespace).get("message") == "0/2 routers ready",
        what="0/2 routers",
    )
    assert service_selector() == router_labels

    # A router child deleted by hand comes back.
    kube.delete(rbac_path(namespace, "roles", "demo-router"))
    eventually(
        lambda: kube.get(rbac_path(namespace, "roles", "demo-router")),
        what="the Role to come back",
    )

    # Off: the Service goes back to the serving pods and everything the router added goes.
    kube.merge(pllm_path(namespace, "demo"), {"spec": {"router": {"enabled": False}}})
    eventually(
        lambda: not any(router_children(kube, namespace).values()),
        what="the router's children to go",
    )
    assert service_selector() == serving
    eventually(
        lambda: router_condition(kube, namespace).get("reason") == "Disabled",
        what="Router Disabled",
    )

    # On again, with one router: no PDB for it.
    kube.merge(pllm_path(namespace, "demo"), {"spec": {"router": {"enabled": True, "replicas": 1}}})
    eventually(
        lambda: (d := kube.get(deployment_path(namespace, "demo-router"))) and d,
        what="the routers to return",
    )
    assert kube.get(deployment_path(namespace, "demo-router"))["spec"]["replicas"] == 1
    assert kube.get(pdb_path(namespace, "demo-router")) is None


def test_a_name_taken_by_something_else_is_reported(kube: Kube, namespace: str) -> None:
    """A Service of someone else's where the router's would go: Degraded, and it is left alone."""
    kube.create(
        f"/api/v1/namespaces/{namespace}/services",
        {
            "metadata": {"name": "demo-serving"},
            "spec": {"selector": {"app": "other"}, "ports": [{"port": 80}]},
        },
    )
    kube.create(pllm_path(namespace), pagedllm("demo", {"model": {"servedName": "demo"}}))
    degraded = wait_for_condition(kube, namespace, "demo", "Degraded", "Degraded", status="True")
    assert (
        'Service "demo-serving" already exists and belongs to something else' in degraded["message"]
    )
    # Someone else's Service is left alone.
    assert kube.get(service_path(namespace, "demo-serving"))["spec"]["selector"] == {"app": "other"}
