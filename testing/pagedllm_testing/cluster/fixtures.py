"""The pytest plugin of the real control plane: one cluster per test session, as envtest
starts one, shared by every test that asks for it (tests/conftest.py and e2e/ load it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedllm_testing.cluster.control_plane import COMPONENTS, ControlPlane


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cluster = ControlPlane(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd and kube-apiserver alone, as envtest runs them: no controller touches what a test
    creates, so a test may write a Deployment's or a pod's status itself."""
    cluster = ControlPlane(tmp_path_factory.mktemp("api-server"), COMPONENTS[:2])
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test shows the tail of the operator's log where it ran one (an `operator` or
    `operator_process` fixture with a `log()`), and of the cluster's components where it used
    the cluster."""
    outcome = yield
    report = outcome.get_result()
    funcargs = getattr(item, "funcargs", {})
    if not report.failed:
        return
    for fixture in ("operator", "operator_process"):
        operator = funcargs.get(fixture)
        if operator is not None and hasattr(operator, "log"):
            report.sections.append(("operator log (tail)", operator.log()[-6000:]))
    cluster = next((v for v in funcargs.values() if isinstance(v, ControlPlane)), None)
    if cluster is not None and cluster.state is not None:
        for name in ("kube-apiserver", "kube-controller-manager"):
            report.sections.append((f"{name} log (tail)", cluster.log_tail(name, 15)))
