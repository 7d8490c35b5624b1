"""Comparing a child the operator would apply with what is live (operator/src/drift.py)."""

from __future__ import annotations

import copy
from typing import Any

from pagedllm.operator.children import Owner, build_children
from pagedllm.operator.drift import APPLIED_ANNOTATION, first_difference, stamped
from pagedllm.operator.spec import parse_spec

OWNER = Owner(name="llama", namespace="models", uid="0b3a2c1e-0000-4000-8000-000000000001")


def children(**spec: Any) -> dict[str, dict[str, Any]]:
    built = build_children(
        OWNER, parse_spec({"model": {"servedName": "x"}, **spec}), 2, False, routers_in_front=True
    )
    return {f"{m['kind']}/{m['metadata']['name']}": stamped(m) for m in built.wanted}


def as_served(manifest: dict[str, Any]) -> dict[str, Any]:
    """What a real API server answers in a list: without the type fields, with server fields
    and defaults added inside maps and list elements."""
    live = copy.deepcopy(manifest)
    del live["apiVersion"], live["kind"]
    live["metadata"].update(uid="u", resourceVersion="7", generation=3, managedFields=[{}])
    live["status"] = {"replicas": 2}
    if manifest["kind"] == "Deployment":
        pod = live["spec"]["template"]["spec"]
        pod["dnsPolicy"] = "ClusterFirst"
        for container in pod["containers"]:
            container["imagePullPolicy"] = "IfNotPresent"
            container["terminationMessagePath"] = "/dev/termination-log"
    return live


def test_every_child_as_served_needs_no_apply() -> None:
    for key, manifest in children(router={"enabled": True}).items():
        assert first_difference(manifest, as_served(manifest)) is None, key


def test_a_changed_owned_field_is_found() -> None:
    deployment = children()["Deployment/llama"]
    live = as_served(deployment)
    live["spec"]["replicas"] = 5  # e.g. someone ran kubectl scale on the Deployment
    assert first_difference(deployment, live) == "/spec/replicas"
    live = as_served(deployment)
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "other"
    assert first_difference(deployment, live) == "/spec/template/spec/containers/0/image"
    live = as_served(deployment)
    live["spec"]["template"]["spec"]["containers"].append({"name": "extra"})
    assert first_difference(deployment, live) == "/spec/template/spec/containers"


def test_a_missing_child_needs_an_apply() -> None:
    assert first_difference(children()["Service/llama"], None) == ""


def test_empty_values_set_may_read_back_absent() -> None:
    wanted = {"metadata": {"name": "a"}, "spec": {"emptyDir": {}, "args": [], "x": None}}
    assert first_difference(wanted, {"metadata": {"name": "a"}, "spec": {}}) is None
    assert first_difference(wanted, {"metadata": {"name": "a"}}) == "/spec"


def test_a_field_no_longer_set_changes_the_fingerprint() -> None:
    """Apply would remove a field the operator stops setting; the rest of the manifest still
    matches, so only the fingerprint tells."""
    old = children(service={"type": "LoadBalancer"})["Service/llama"]
    new = copy.deepcopy(old)
    del new["metadata"]["annotations"][APPLIED_ANNOTATION]
    del new["spec"]["type"]
    restamped = stamped(new)
    escaped = APPLIED_ANNOTATION.replace("/", "~1")
    assert first_difference(restamped, as_served(old)) == f"/metadata/annotations/{escaped}"


def test_a_spec_change_touches_only_the_children_it_changes() -> None:
    before = children(router={"enabled": True, "replicas": 2})
    after = children(router={"enabled": True, "replicas": 3})
    assert set(before) == set(after)
    changed = {
        key
        for key, manifest in after.items()
        if first_difference(manifest, as_served(before[key])) is not None
    }
    assert changed == {"Deployment/llama-router"}


def test_quantities_compare_by_value() -> None:
    """The API server canonicalizes quantities; the same amount written another way is no
    difference, another amount is."""
    deployment = children(resources={"limits": {"cpu": 2, "memory": "1.5Gi"}})["Deployment/llama"]
    live = as_served(deployment)
    resources = live["spec"]["template"]["spec"]["containers"][0]["resources"]
    resources["limits"] = {"cpu": "2", "memory": "1536Mi"}
    assert first_difference(deployment, live) is None
    resources["limits"] = {"cpu": "2500m", "memory": "1536Mi"}
    assert first_difference(deployment, live) == (
        "/spec/template/spec/containers/0/resources/limits/cpu"
    )
    # Elsewhere a number and its string are different values.
    service = children()["Service/llama"]
    live = as_served(service)
    live["spec"]["ports"][0]["port"] = str(live["spec"]["ports"][0]["port"])
    assert first_difference(service, live) == "/spec/ports/0/port"


def test_extended_resources_compare_by_value() -> None:
    """`nvidia.com/gpu: 1` reads back as "1": the same amount, no difference (the resource's
    name holds a slash, escaped in the path as JSON pointers do); another amount is one."""
    deployment = children(resources={"limits": {"nvidia.com/gpu": 1}})["Deployment/llama"]
    live = as_served(deployment)
    resources = live["spec"]["template"]["spec"]["containers"][0]["resources"]
    resources["limits"]["nvidia.com/gpu"] = "1"
    assert first_difference(deployment, live) is None
    resources["limits"]["nvidia.com/gpu"] = "2"
    assert first_difference(deployment, live) == (
        "/spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu"
    )
