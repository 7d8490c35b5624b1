"""What the operator relies on the kube-apiserver and the garbage collector for, on the session's
control plane: the PagedLLM's generation moves with its spec only (status writes never make the
operator's own work look unfinished), server-side apply drops what the operator stopped setting
and keeps what others set, and children the operator applies just after their PagedLLM was
deleted are collected."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from pagedllm.operator.children import Owner, build_children
from pagedllm.operator.kube import KubeClient
from pagedllm.operator.spec import parse_spec
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.operator_harness import (
    Kube,
    deployment_path,
    eventually,
    pagedllm,
    pllm_path,
)

pytestmark = pytest.mark.usefixtures("crd")


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    return control_plane


def admin_client(cluster: ControlPlane) -> KubeClient:
    """The operator's client, logged in as the admin."""
    return KubeClient(
        lambda: kopf.ConnectionInfo(
            server=cluster.server,
            ca_path=cluster.ca,
            certificate_path=cluster.admin.cert,
            private_key_path=cluster.admin.key,
        )
    )


def test_the_generation_moves_with_the_spec_only(kube: Kube, namespace: str) -> None:
    """Labels and status leave metadata.generation alone (the operator's observedGeneration
    catches up with its own status write); spec changes and /scale move it, and a patch that
    changes nothing writes nothing."""
    kube.create(pllm_path(namespace), pagedllm("gen", {"model": {"servedName": "gen"}}))
    path = pllm_path(namespace, "gen")
    assert kube.merge(path, {"metadata": {"labels": {"a": "b"}}})["metadata"]["generation"] == 1
    written = kube.merge(path + "/status", {"status": {"observedGeneration": 1}})
    assert written["metadata"]["generation"] == 1
    # Status through the main resource is ignored: only /status writes it.
    ignored = kube.merge(path, {"status": {"observedGeneration": 9}})
    assert ignored["status"]["observedGeneration"] == 1
    assert kube.merge(path, {"spec": {"engine": {"maxNumSeqs": 4}}})["metadata"]["generation"] == 2
    kube.merge(path + "/scale", {"spec": {"replicas": 2}})
    assert kube.get(path)["metadata"]["generation"] == 3
    same = kube.get(path)
    again = kube.merge(path, {"spec": {"engine": {"maxNumSeqs": 4}}})
    assert again["metadata"]["resourceVersion"] == same["metadata"]["resourceVersion"]


def deployment(name: str, namespace: str, node_selector: dict[str, str] | None) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [{"name": "c", "image": "i"}]}
    if node_selector:
        pod["nodeSelector"] = node_selector
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod},
        },
    }


def test_apply_drops_what_the_operator_stopped_setting(
    cluster: ControlPlane, kube: Kube, namespace: str
) -> None:
    """A spec change that leaves a field out of the child (here the nodeSelector) removes it
    from the live object; what another manager set stays."""

    async def scenario() -> dict[str, Any]:
        client = admin_client(cluster)
        try:
            await client.apply(deployment("applied", namespace, {"gpu": "l4"}))
            kube.merge(
                deployment_path(namespace, "applied"),
                {"metadata": {"annotations": {"someone": "else"}}},
            )
            return await client.apply(deployment("applied", namespace, None))
        finally:
            await client.close()

    result = asyncio.run(scenario())
    assert "nodeSelector" not in result["spec"]["template"]["spec"]
    assert result["metadata"]["annotations"]["someone"] == "else"


def test_children_applied_after_their_pagedllm_is_gone_are_collected(
    cluster: ControlPlane, kube: Kube, namespace: str
) -> None:
    """The operator read its PagedLLM just before the PagedLLM's deletion and applies the
    children after it: the garbage collector finds their owner gone and removes them. The
    children of a PagedLLM that still exists stay."""
    spec = parse_spec({"model": {"servedName": "x"}, "adapters": [{"name": "a", "uri": "/a"}]})
    owners = {
        name: Owner.from_body(
            kube.create(pllm_path(namespace), pagedllm(name, {"model": {"servedName": name}}))
        )
        for name in ("kept", "gone")
    }
    kube.delete(pllm_path(namespace, "gone"))
    eventually(lambda: kube.get(pllm_path(namespace, "gone")) is None, what="the PagedLLM gone")

    def children(owner: Owner) -> list[dict[str, Any]]:
        return build_children(owner, spec, 2, False).wanted

    async def scenario() -> None:
        client = admin_client(cluster)
        try:
            for owner in ("kept", "gone"):
                for child in children(owners[owner]):
                    await client.apply(child)
        finally:
            await client.close()

    asyncio.run(scenario())

    def path(child: dict[str, Any]) -> str:
        version = child["apiVersion"]
        prefix = "/api/v1" if version == "v1" else f"/apis/{version}"
        plural = child["kind"].lower() + "s"  # so for every kind of child
        return f"{prefix}/namespaces/{namespace}/{plural}/{child['metadata']['name']}"

    dangling = [path(c) for c in children(owners["gone"])]
    assert len(dangling) >= 6, dangling
    eventually(
        lambda: [p for p in dangling if kube.get(p) is not None] == [],
        timeout=30,
        what="the garbage collector to remove the dangling children",
    )
    assert all(kube.get(path(c)) is not None for c in children(owners["kept"]))
