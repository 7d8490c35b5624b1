"""Fixtures for the operator suite: the API emulator on loopback with the CRD installed, and
the real operator running against it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedllm_testing.operator_harness import (
    KOPF_RUN,
    EmulatorThread,
    Kube,
    Kubectl,
    OperatorProcess,
    kubeconfig_text,
    kubectl_for,
    load_crd,
)


@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorThread]:
    with EmulatorThread(bookmark_interval=2.0) as running:
        yield running


@pytest.fixture(scope="module")
def crd(kube: Kube) -> dict[str, Any]:
    """The PagedLLM CRD, installed through the API."""
    return kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", load_crd())


@pytest.fixture(scope="module")
def kube(emulator: EmulatorThread) -> Kube:
    return Kube(emulator.url)


@pytest.fixture(scope="module")
def kubeconfig(emulator: EmulatorThread, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kube") / "config"
    path.write_text(kubeconfig_text(emulator.url))
    return path


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
def namespace(kube: Kube) -> str:
    """A fresh namespace per test, so tests sharing one operator never see each other."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.create("/api/v1/namespaces", {"metadata": {"name": name}})
    return name


@pytest.fixture
def kubectl(kubeconfig: Path, namespace: str) -> Kubectl:
    return kubectl_for(kubeconfig, namespace)
