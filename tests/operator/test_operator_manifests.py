"""The kustomize base renders, its RBAC is least-privilege, its workloads are valid."""

from __future__ import annotations

import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pagedllm.operator.children import (
    Owner,
    build_children,
    build_router_rbac,
    router_rbac_rules,
)
from pagedllm.operator.live import CHILD_KINDS, SERVICE_MONITOR_KIND
from pagedllm.operator.spec import parse_spec
from pagedllm_testing.cluster import binary
from pagedllm_testing.operator_harness import REPO

# Every call the operator and kopf make, as (apiGroup, resource, verb).
NEEDED = {("pagedllm.io", "pagedllms", verb) for verb in ("get", "list", "watch", "patch")} | {
    ("pagedllm.io", "pagedllms/status", "patch"),
    ("pagedllm.io", "pagedllms/scale", "patch"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "get"),
    ("apps", "deployments", "create"),
    ("apps", "deployments", "patch"),
    ("apps", "deployments", "watch"),
    ("", "services", "patch"),
    ("", "services", "watch"),
    ("policy", "poddisruptionbudgets", "delete"),
    ("autoscaling", "horizontalpodautoscalers", "patch"),
    ("", "pods", "list"),
    ("", "persistentvolumeclaims", "get"),
    ("", "events", "create"),
}

OWNER = Owner(name="llama", namespace="models", uid="0b3a2c1e-0000-4000-8000-000000000001")


def _resource(api_version: str, kind: str) -> tuple[str, str]:
    group = api_version.rpartition("/")[0]
    plural = {"PodDisruptionBudget": "poddisruptionbudgets"}.get(kind, kind.lower() + "s")
    return group, plural


def children_calls() -> set[tuple[str, str, str]]:
    """The calls reconcile makes on children: get and apply (create, patch) of what any spec
    wants, get and delete of what it no longer wants; and the resync's list of every kind."""
    calls = {
        (*_resource(api_version, kind), "list")
        for api_version, kind in (*CHILD_KINDS, SERVICE_MONITOR_KIND, ("v1", "Pod"))
    }
    for enabled in (True, False):
        spec = parse_spec(
            {
                "model": {"servedName": "x"},
                "replicas": 2,
                "autoscaling": None,
                "router": {"enabled": enabled},
            }
        )
        children = build_children(OWNER, spec, 2, service_monitors_available=False)
        for manifest in children.wanted:
            group, plural = _resource(manifest["apiVersion"], manifest["kind"])
            calls |= {(group, plural, verb) for verb in ("get", "create", "patch")}
        for ref in children.unwanted:
            group, plural = _resource(ref.api_version, ref.kind)
            calls |= {(group, plural, verb) for verb in ("get", "delete")}
    return calls


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    result = subprocess.run(
        [binary.kubectl(), "kustomize", str(REPO / "manifests")],
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def by_kind(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in documents if d["kind"] == kind]
    return found


def test_renders_the_whole_install(rendered: list[dict[str, Any]]) -> None:
    assert sorted(d["kind"] for d in rendered) == sorted(
        [
            "Namespace",
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "ConfigMap",  # the Grafana dashboard
        ]
    )
    binding = by_kind(rendered, "ClusterRoleBinding")
    account = by_kind(rendered, "ServiceAccount")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
    ]


def test_rbac_has_no_wildcards_and_covers_every_call(rendered: list[dict[str, Any]]) -> None:
    rules = by_kind(rendered, "ClusterRole")["rules"]
    granted = set()
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], rule
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule
        granted |= {
            (g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
        }
    assert NEEDED - granted == set()
    assert children_calls() - granted == set()
    # Kubernetes lets the operator create the routers' Role only with what it grants.
    router_grants = {
        (g, r, v)
        for rule in router_rbac_rules("x")
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert router_grants - granted == set()
    assert not any(r == "secrets" for _, r, _ in granted)


def test_routers_may_only_read_endpointslices_and_scale_their_own_pagedllm() -> None:
    spec = parse_spec({"model": {"servedName": "x"}})
    role = next(m for m in build_router_rbac(OWNER) if m["kind"] == "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": ["pagedllm.io"],
            "resources": ["pagedllms/scale"],
            "resourceNames": [OWNER.name],
            "verbs": ["get", "patch"],
        },
    ]
    assert "ClusterRole" not in {m["kind"] for m in build_children(OWNER, spec, 1, False).wanted}


def test_operator_deployment(rendered: list[dict[str, Any]]) -> None:
    deployment = by_kind(rendered, "Deployment")
    kubernetes_validate.validate(deployment, "1.32", strict=True)
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["pagedllm", "operator"]
    liveness = next(a for a in container["args"] if a.startswith("--liveness="))
    assert liveness.endswith(container["livenessProbe"]["httpGet"]["path"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def test_samples_render_as_a_kustomization() -> None:
    result = subprocess.run(
        [binary.kubectl(), "kustomize", str(REPO / "manifests" / "samples")],
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout) if d]
    assert kinds.count("PagedLLM") == 2


def test_dockerfile_builds_from_the_repository_root() -> None:
    dockerfile = (REPO / "manifests" / "Dockerfile").read_text()
    for path in ("node", "kernels", "operator", "pyproject.toml", "requirements"):
        assert path in dockerfile
        assert (REPO / path).exists()
    assert "ARG TORCH_VARIANT=cpu" in dockerfile
    # Both variants install from their lock, hashes checked: the CPU image torch's CPU build
    # and the serve set without the CUDA libraries, the CUDA image the CUDA set.
    for lock in ("bootstrap.txt", "image-torch-cpu.txt", "image-cpu.txt", "cuda.txt"):
        assert (REPO / "requirements" / lock).exists()
        assert "pip install --require-hashes" in dockerfile
        assert f"-r requirements/{lock}" in dockerfile
