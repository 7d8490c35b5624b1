"""LoRA adapters on the local cluster (local_cluster.py: the real control plane), end to end:
apply a PagedLLM with two adapters and call each through its Service (the router in front of
the serving pod) with the openai SDK; add a third to the spec and call it with no pod restarted
or replaced (the pods' ConfigMap volume changes, not their template); scale to two and call the
third adapter on the new pod itself. The status counts the pods serving each adapter all
along."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedllm_testing.client_checks import client as openai_client
from pagedllm_testing.local_cluster import (
    NAMESPACE,
    REPO,
    ClusterShape,
    LocalCluster,
    eventually,
    is_pod_ready,
    local_url,
)
from pagedllm_testing.lora_adapters import demo_adapter

NAME = "tuned"
MODEL = "demo"
PLLM = f"/apis/pagedllm.io/v1alpha1/namespaces/{NAMESPACE}/pagedllms/{NAME}"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
SELECTOR = f"app.kubernetes.io/name=pagedllm,pagedllm.io/instance={NAME}"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{NAME}"


def resource(adapters: list[dict[str, Any]]) -> dict[str, Any]:
    """The demo model, one serving pod and one router."""
    return {
        "apiVersion": "pagedllm.io/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"servedName": MODEL},
            "replicas": 1,
            "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}},
            "engine": {"dtype": "float32", "maxNumSeqs": 4, "kvCacheMemory": "32Mi"},
            "router": {"replicas": 1},
            "lora": {"maxLoras": 2, "maxCpuLoras": 3},
            "adapters": adapters,
            "drainTimeoutSeconds": 5,
        },
    }


def loaded(cluster: LocalCluster, wanted: dict[str, int]) -> bool:
    """Whether status.adapters counts exactly `wanted` (adapter -> pods)."""
    body = cluster.get(PLLM) or {}
    found = {a["name"]: a["loadedPods"] for a in (body.get("status") or {}).get("adapters") or []}
    return found == wanted


def serving_pods(cluster: LocalCluster) -> list[dict[str, Any]]:
    return [p for p in cluster.list(PODS, SELECTOR) if is_pod_ready(p)]


def restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or [])


def answer_model(base_url: str, model: str) -> str:
    """The model a completion through `base_url` answers as (an adapter answers as itself)."""
    response = openai_client(base_url, None).completions.create(
        model=model, prompt="Once upon a time", max_tokens=4, temperature=0
    )
    assert response.choices[0].text is not None
    return response.model


@pytest.mark.timeout(300)
def test_adapters_reach_running_and_new_pods(tmp_path_factory: pytest.TempPathFactory) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="pllm-lora-"))  # short: the node's unix sockets
    # One node is enough: one serving pod, then two (no GPU asked), and a router.
    cluster = LocalCluster(workdir, ClusterShape(gpu_nodes=0))
    # The host's files are the image's (process kubelet): adapters at absolute paths.
    made = tmp_path_factory.mktemp("adapters")
    adapters = [
        {"name": "sql", "uri": str(demo_adapter(made / "sql", 0)), "preload": True},
        {"name": "poet", "uri": str(demo_adapter(made / "poet", 1, ["o_proj"]))},
        {"name": "legal", "uri": str(demo_adapter(made / "legal", 2, ["gate_proj"]))},
    ]
    manifest = workdir / "tuned.yaml"
    try:
        cluster.start()
        cluster.kubectl("apply", "-k", str(REPO / "manifests"))
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/pagedllms.pagedllm.io", "--timeout=30s"
        )
        cluster.start_operator()

        manifest.write_text(yaml.safe_dump(resource(adapters[:2])))
        cluster.kubectl("apply", "-f", str(manifest))
        cluster.kubectl(
            "wait", "--for=condition=Ready", f"pllm/{NAME}", "--timeout=180s", timeout=200
        )
        eventually(lambda: loaded(cluster, {"sql": 1, "poet": 1}), timeout=30, what="2 adapters")
        base_url = cluster.service_url(NAME) + "/v1"
        for name in ("sql", "poet", MODEL):
            assert answer_model(base_url, name) == name

        (first,) = serving_pods(cluster)
        generation = cluster.get(DEPLOYMENT)["metadata"]["generation"]  # type: ignore[index]
        cluster.kubectl(
            "patch",
            "pllm",
            NAME,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"adapters": adapters}}),
        )
        eventually(
            lambda: loaded(cluster, {"sql": 1, "poet": 1, "legal": 1}),
            timeout=30,
            what="the third adapter on the running pod",
        )
        assert answer_model(base_url, "legal") == "legal"
        (still,) = serving_pods(cluster)
        assert still["metadata"]["uid"] == first["metadata"]["uid"]
        assert restarts(still) == restarts(first) == 0
        # No rollout: the pod template did not change.
        assert cluster.get(DEPLOYMENT)["metadata"]["generation"] == generation  # type: ignore[index]

        cluster.kubectl("scale", f"pllm/{NAME}", "--replicas=2")
        cluster.kubectl(
            "wait",
            "--for=jsonpath={.status.readyReplicas}=2",
            f"pllm/{NAME}",
            "--timeout=180s",
            timeout=200,
        )
        (new,) = [
            p for p in serving_pods(cluster) if p["metadata"]["uid"] != first["metadata"]["uid"]
        ]
        assert answer_model(local_url(new) + "/v1", "legal") == "legal"
        eventually(
            lambda: loaded(cluster, {"sql": 2, "poet": 2, "legal": 2}),
            timeout=30,
            what="every adapter on both pods",
        )
    except BaseException:
        print(cluster.diagnostics())
        raise
    finally:
        cluster.stop()
        left = cluster.live_processes()
    assert not left, f"processes left behind: {left}"
    shutil.rmtree(workdir)  # kept when the test fails, for its logs
