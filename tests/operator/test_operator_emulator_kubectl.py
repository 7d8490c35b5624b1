"""What a user sees with the real kubectl against the emulator: `kubectl explain` from the
CRD's published schema, `kubectl get` with a real API server's columns. (The documentation's
cluster-less example, the getting-started tour, runs as written in tests/docs/test_tour.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from pagedllm_testing.operator_harness import (
    CRD_PATH,
    SAMPLES,
    EmulatorThread,
    Kube,
    Kubectl,
    kubeconfig_text,
    kubectl_for,
)


def rows(output: str) -> list[list[str]]:
    """`kubectl get` output as cells; columns are separated by two spaces or more."""
    return [re.split(r"\s{2,}", line.strip()) for line in output.strip().splitlines()]


def apply(kubectl: Kubectl, *objects: dict[str, Any]) -> None:
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))


def test_explain_prints_the_fields_of_the_crd_schema(kubectl: Kubectl, crd: dict) -> None:
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    out = kubectl("explain", "pagedllm.spec").stdout
    assert "KIND:       PagedLLM" in out
    assert spec["description"] in out
    listed = re.findall(r"^  (\w+)\t", out, flags=re.MULTILINE)
    assert listed == sorted(spec["properties"])
    assert "-required-" in re.search(r"^  model\t.*$", out, flags=re.MULTILINE).group(0)

    nested = kubectl("explain", "pagedllm.spec.model.servedName").stdout
    assert "FIELD: servedName <string>" in nested
    top = kubectl("explain", "pagedllm").stdout
    assert "metadata\t<ObjectMeta>" in top

    # The same from OpenAPI v2, which kubectl reads in protobuf.
    v2 = kubectl("explain", "pagedllm.spec", "--output", "plaintext-openapiv2").stdout
    assert "RESOURCE: spec <Object>" in v2
    assert re.findall(r"^   (\w+)\t", v2, flags=re.MULTILINE) == sorted(spec["properties"])


def test_router_fields_are_explained_and_checked(kubectl: Kubectl, crd: dict) -> None:
    out = kubectl("explain", "pagedllm.spec.router").stdout
    assert re.findall(r"^  (\w+)\t", out, flags=re.MULTILINE) == [
        "enabled",
        "holdTimeoutSeconds",
        "loadBound",
        "maxHeldRequests",
        "policy",
        "replicas",
        "resources",
    ]
    assert "enabled false" in out
    bad = {
        "apiVersion": "pagedllm.io/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": "bad-router"},
        "spec": {"model": {"servedName": "x"}, "router": {"policy": "random", "replicas": 0}},
    }
    rejected = kubectl("apply", "-f", "-", stdin=yaml.safe_dump(bad), check=False)
    assert rejected.returncode != 0
    assert "spec.router.policy" in rejected.stderr and "spec.router.replicas" in rejected.stderr
    good = {**bad, "spec": {"model": {"servedName": "x"}}}
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(good))
    router = kubectl("get", "pllm", "bad-router", "-o", "jsonpath={.spec.router}").stdout
    assert yaml.safe_load(router) == {
        "enabled": True,
        "replicas": 2,
        "policy": "prefix",
        "loadBound": 1.25,
        "maxHeldRequests": 64,
        "holdTimeoutSeconds": 600,
    }


def test_get_deployments_shows_readiness_from_the_status(
    kubectl: Kubectl, kube: Kube, namespace: str
) -> None:
    labels = {"app": "web"}
    apply(
        kubectl,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "server", "image": "nginx:1.27"}]},
                },
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "fresh"},
            "spec": {
                "selector": {"matchLabels": {"app": "fresh"}},
                "template": {
                    "metadata": {"labels": {"app": "fresh"}},
                    "spec": {"containers": [{"name": "server", "image": "nginx:1.27"}]},
                },
            },
        },
    )
    kube.merge(
        f"/apis/apps/v1/namespaces/{namespace}/deployments/web/status",
        {
            "status": {
                "replicas": 3,
                "updatedReplicas": 2,
                "readyReplicas": 1,
                "availableReplicas": 1,
            }
        },
    )

    table = rows(kubectl("get", "deploy").stdout)
    assert table[0] == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    by_name = {row[0]: row[1:4] for row in table[1:]}
    assert by_name == {"fresh": ["0/1", "0", "0"], "web": ["1/3", "2", "1"]}

    wide = rows(kubectl("get", "deploy", "web", "-o", "wide").stdout)
    assert wide[0][5:] == ["CONTAINERS", "IMAGES", "SELECTOR"]
    assert wide[1][5:] == ["server", "nginx:1.27", "app=web"]


def test_get_pods_shows_readiness_status_and_restarts(
    kubectl: Kubectl, kube: Kube, namespace: str
) -> None:
    containers = [{"name": "server", "image": "nginx:1.27"}, {"name": "sidecar", "image": "x:1"}]
    apply(
        kubectl,
        *(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
            for name, spec in (
                ("crashing", {"containers": containers}),
                ("scheduled", {"containers": containers[:1]}),
            )
        ),
    )
    kube.merge(
        f"/api/v1/namespaces/{namespace}/pods/crashing/status",
        {
            "status": {
                "phase": "Running",
                "podIP": "10.1.2.3",
                "containerStatuses": [
                    {"name": "server", "ready": True, "restartCount": 2, "state": {"running": {}}},
                    {
                        "name": "sidecar",
                        "ready": False,
                        "restartCount": 1,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    },
                ],
            }
        },
    )

    table = rows(kubectl("get", "pods").stdout)
    assert table[0] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    by_name = {row[0]: row[1:4] for row in table[1:]}
    assert by_name == {
        "crashing": ["1/2", "CrashLoopBackOff", "3"],
        "scheduled": ["0/1", "Pending", "0"],
    }
    wide = rows(kubectl("get", "pod", "crashing", "-o", "wide").stdout)
    assert wide[0][5:7] == ["IP", "NODE"]
    assert wide[1][5:7] == ["10.1.2.3", "<none>"]

    kube.merge(f"/api/v1/namespaces/{namespace}/pods/crashing", {"metadata": {"finalizers": ["x"]}})
    kubectl("delete", "pod", "crashing", "--wait=false")
    assert rows(kubectl("get", "pod", "crashing").stdout)[1][2] == "Terminating"


def test_get_services_and_replicasets(kubectl: Kubectl, namespace: str) -> None:
    apply(
        kubectl,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {
                "clusterIP": "10.96.0.10",
                "selector": {"app": "web"},
                "ports": [{"port": 80, "targetPort": 8080}],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "edge"},
            "spec": {
                "type": "NodePort",
                "ports": [{"port": 443, "nodePort": 30443, "protocol": "TCP"}],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {"name": "web-5d9c"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {"containers": [{"name": "server", "image": "nginx:1.27"}]},
                },
            },
        },
    )
    services = rows(kubectl("get", "svc").stdout)
    assert services[0] == ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"]
    by_name = {row[0]: row[1:5] for row in services[1:]}
    assert by_name == {
        "edge": ["NodePort", "<none>", "<none>", "443:30443/TCP"],
        "web": ["ClusterIP", "10.96.0.10", "<none>", "80/TCP"],
    }

    replicasets = rows(kubectl("get", "rs").stdout)
    assert replicasets[0] == ["NAME", "DESIRED", "CURRENT", "READY", "AGE"]
    assert replicasets[1][:4] == ["web-5d9c", "2", "0", "0"]


def test_crd_and_custom_resource_in_one_apply_fail_as_on_a_cluster(tmp_path: Path) -> None:
    """Before the CRD exists its kind is in no OpenAPI v3 document: kubectl validates the
    sample against OpenAPI v2 (protobuf), which passes, and then finds no such kind, as on a
    real cluster (hence the getting-started tour's wait)."""
    with EmulatorThread() as fresh:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(kubeconfig_text(fresh.url))
        kubectl = kubectl_for(kubeconfig, "default")
        result = kubectl(
            "apply",
            "--cache-dir",
            str(tmp_path / "cache"),
            "-f",
            str(CRD_PATH),
            "-f",
            str(SAMPLES / "demo-cpu.yaml"),
            check=False,
        )
    assert "customresourcedefinition.apiextensions.k8s.io/pagedllms.pagedllm.io created" in (
        result.stdout
    )
    assert "error validating" not in result.stderr
    assert 'no matches for kind "PagedLLM"' in result.stderr
    assert "ensure CRDs are installed first" in result.stderr
