"""Fixtures for the operator suite: the session's real kube-apiserver (pagedllm_testing.cluster)
with the CRD installed, the admin's REST client and kubeconfig, a fresh namespace per test, and
the real operator running against it.

A module's `cluster` is `api_server` (etcd and kube-apiserver alone, as envtest runs them: a
test writes the statuses the controllers and kubelets would) unless the module overrides the
fixture with `control_plane`, where the real controllers act (garbage collection, ReplicaSets,
the disruption controller)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.operator_harness import (
    CRD_PATH,
    KOPF_RUN,
    Kube,
    Kubectl,
    KubeError,
    OperatorProcess,
    create_node,
    eventually,
    kubectl_for,
    pllm_path,
)

CRD_NAME = "pagedllms.pagedllm.io"


@pytest.fixture(scope="module")
def cluster(api_server: ControlPlane) -> ControlPlane:
    """The cluster of the module's tests: the session's api_server, unless the module
    overrides this fixture with control_plane."""
    return api_server


@pytest.fixture(scope="module")
def kube(cluster: ControlPlane) -> Iterator[Kube]:
    client = Kube.admin(cluster)
    yield client
    client.close()


OPENAPI_V3 = "/openapi/v3/apis/pagedllm.io/v1alpha1"


def install_crd(cluster: ControlPlane) -> None:
    """crds/pagedllm.yaml applied (server-side: the session's cluster may have it already,
    from another module or `kubectl apply` in a test) and Established."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    # The apiserver publishes a new kind's OpenAPI (what `kubectl explain` reads) a moment after
    # Established, and kubectl caches discovery: wait for the one, refresh the other.
    eventually(
        lambda: cluster.kubectl("get", "--raw", OPENAPI_V3, check=False).returncode == 0,
        what="the CRD's OpenAPI v3",
    )
    eventually(
        lambda: (
            "io.pagedllm.v1alpha1.PagedLLM"
            in cluster.kubectl("get", "--raw", "/openapi/v2", check=False).stdout
        ),
        what="the CRD in OpenAPI v2",
    )
    cluster.kubectl("api-resources", "--api-group=pagedllm.io")


@pytest.fixture(scope="module")
def crd(cluster: ControlPlane, kube: Kube) -> dict[str, Any]:
    """The PagedLLM CRD as the apiserver serves it."""
    install_crd(cluster)
    return kube.request(
        "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"
    )


@pytest.fixture(scope="module")
def kubeconfig(cluster: ControlPlane) -> Path:
    """The admin's kubeconfig (a client certificate of system:masters)."""
    return cluster.layout.kubeconfig


@pytest.fixture(scope="module")
def operator_process(
    kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator"), KOPF_RUN)
    process.start()
    yield process
    if process.process is not None:
        process.stop()


@pytest.fixture
def namespace(cluster: ControlPlane, kube: Kube) -> Iterator[str]:
    """A fresh namespace per test: tests sharing a cluster and an operator (which watches all
    namespaces) never see each other. Its PagedLLMs are deleted afterwards, so that no later
    operator of the session reconciles them, and then the namespace."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.create("/api/v1/namespaces", {"metadata": {"name": name}})
    # Pods are admitted only with their ServiceAccount, which the ServiceAccount controller
    # creates in every namespace; without the controller (api_server), the test does.
    account = f"/api/v1/namespaces/{name}/serviceaccounts"
    if "kube-controller-manager" in cluster.components:
        eventually(lambda: kube.get(f"{account}/default"), what="the default ServiceAccount")
    else:
        kube.create(account, {"metadata": {"name": "default"}})
    yield name
    try:
        kube.request("DELETE", pllm_path(name))
    except KubeError as error:
        if error.status != 404:  # no CRD installed: no PagedLLM either
            raise
    kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture
def node(kube: Kube, namespace: str) -> Iterator[str]:
    """A Node of the test's own, registered as a kubelet would before its first status (see
    operator_harness.create_node): pods bound to it may be reported running and ready."""
    name = f"node-{namespace}"
    create_node(kube, name)
    yield name
    kube.delete(f"/api/v1/nodes/{name}")


@pytest.fixture
def kubectl(kubeconfig: Path, namespace: str) -> Kubectl:
    return kubectl_for(kubeconfig, namespace)
