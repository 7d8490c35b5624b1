"""What a user sees with the built kubectl against the real kube-apiserver (envtest's: the test
writes the statuses): `kubectl explain` from the CRD's published schema (OpenAPI v3 and v2), and
`kubectl get` with the apiserver's own columns for the kinds the operator makes."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import yaml

from pagedllm_testing.cluster.control_plane import SERVICE_CLUSTER_IP_RANGE
from pagedllm_testing.operator_harness import ROUTER_DEFAULTS, Kube, Kubectl


def rows(output: str) -> list[list[str]]:
    """`kubectl get` output as cells; columns are separated by two spaces or more."""
    return [re.split(r"\s{2,}", line.strip()) for line in output.strip().splitlines()]


def apply(kubectl: Kubectl, *objects: dict[str, Any]) -> None:
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))


def test_explain_prints_the_fields_of_the_crd_schema(kubectl: Kubectl, crd: dict) -> None:
    """`kubectl explain` lists the spec's fields from the CRD's schema as the apiserver
    publishes it, in OpenAPI v3 and (protobuf) v2."""
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
    """spec.router's fields are explained; bad values are refused by the schema, and the
    apiserver's defaults fill in an omitted router."""
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
    assert yaml.safe_load(router) == ROUTER_DEFAULTS


def test_get_deployments_shows_readiness_from_the_status(
    kubectl: Kubectl, kube: Kube, namespace: str
) -> None:
    """`kubectl get deploy` shows READY, UP-TO-DATE and AVAILABLE from the status the test
    writes (as the Deployment controller would), and -o wide the containers and selector."""
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
    """`kubectl get pods` shows ready containers, the waiting reason and the restarts from the
    status the test writes (as the kubelet would), and Terminating while a finalizer holds a
    deleted pod."""
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

    # Held by a finalizer, a deleted pod shows as Terminating until the finalizer goes.
    pod = f"/api/v1/namespaces/{namespace}/pods/crashing"
    kube.merge(pod, {"metadata": {"finalizers": ["pagedllm.io/test-hold"]}})
    kubectl("delete", "pod", "crashing", "--wait=false")
    assert rows(kubectl("get", "pod", "crashing").stdout)[1][2] == "Terminating"
    kube.merge(pod, {"metadata": {"finalizers": None}})
    assert kube.get(pod) is None


def test_get_services_and_replicasets(kubectl: Kubectl, namespace: str) -> None:
    """`kubectl get svc` and `get rs` columns: cluster IPs (a NodePort Service gets one from
    the service range), ports, and a ReplicaSet no controller acts on."""
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
    # A NodePort Service gets a cluster IP of its own, from the service range.
    edge_ip = by_name["edge"].pop(1)
    assert ipaddress.ip_address(edge_ip) in ipaddress.ip_network(SERVICE_CLUSTER_IP_RANGE)
    assert by_name == {
        "edge": ["NodePort", "<none>", "443:30443/TCP"],
        "web": ["ClusterIP", "10.96.0.10", "<none>", "80/TCP"],
    }

    replicasets = rows(kubectl("get", "rs").stdout)
    assert replicasets[0] == ["NAME", "DESIRED", "CURRENT", "READY", "AGE"]
    assert replicasets[1][:4] == ["web-5d9c", "2", "0", "0"]
