"""The API emulator behaves like an API server where kopf, kubectl and the operator rely on it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from pagedllm_testing.operator_harness import Kube, KubeError, eventually, load_crd, pagedllm

DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"


def deployment(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        },
    }


def test_server_fields_and_errors(kube: Kube) -> None:
    created = kube.create(DEPLOYMENTS, {**deployment("web"), "status": {"readyReplicas": 5}})
    assert "status" not in created  # status is written through /status only
    metadata = created["metadata"]
    assert metadata["namespace"] == "default" and metadata["generation"] == 1
    assert metadata["uid"] and metadata["resourceVersion"] and metadata["creationTimestamp"]

    with pytest.raises(KubeError) as exists:
        kube.create(DEPLOYMENTS, deployment("web"))
    assert (exists.value.status, exists.value.body["reason"]) == (409, "AlreadyExists")
    with pytest.raises(KubeError) as missing:
        kube.request("GET", f"{DEPLOYMENTS}/nope")
    assert (missing.value.status, missing.value.body["reason"]) == (404, "NotFound")

    stale = dict(created, spec={**created["spec"], "replicas": 2})
    kube.merge(f"{DEPLOYMENTS}/web", {"spec": {"replicas": 3}})
    with pytest.raises(KubeError) as conflict:
        kube.request("PUT", f"{DEPLOYMENTS}/web", stale)
    assert (conflict.value.status, conflict.value.body["reason"]) == (409, "Conflict")

    failed_test = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]},
    ]
    with pytest.raises(KubeError) as invalid:
        kube.request("PATCH", f"{DEPLOYMENTS}/web", failed_test, "application/json-patch+json")
    assert invalid.value.status == 422
    assert "finalizers" not in kube.get(f"{DEPLOYMENTS}/web")["metadata"]


def test_generation_moves_with_spec_only(kube: Kube) -> None:
    kube.create(DEPLOYMENTS, deployment("gen"))
    path = f"{DEPLOYMENTS}/gen"
    assert kube.merge(path, {"metadata": {"labels": {"a": "b"}}})["metadata"]["generation"] == 1
    assert (
        kube.merge(path + "/status", {"status": {"readyReplicas": 1}})["metadata"]["generation"]
        == 1
    )
    assert kube.merge(path, {"status": {"readyReplicas": 9}})["status"]["readyReplicas"] == 1
    assert kube.merge(path, {"spec": {"replicas": 4}})["metadata"]["generation"] == 2
    same = kube.get(path)
    again = kube.merge(path, {"spec": {"replicas": 4}})
    assert again["metadata"]["resourceVersion"] == same["metadata"]["resourceVersion"]


def test_server_side_apply_drops_what_the_manager_stopped_setting(kube: Kube) -> None:
    def apply(body: dict[str, Any]) -> dict[str, Any]:
        return kube.request(
            "PATCH",
            f"{DEPLOYMENTS}/applied",
            body,
            "application/apply-patch+yaml",
            fieldManager="me",
            force="true",
        )

    first = deployment("applied")
    first["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "yes"}
    apply(first)
    kube.merge(f"{DEPLOYMENTS}/applied", {"metadata": {"annotations": {"someone": "else"}}})
    result = apply(deployment("applied"))
    assert "nodeSelector" not in result["spec"]["template"]["spec"]
    assert result["metadata"]["annotations"] == {"someone": "else"}


def test_list_then_watch_from_a_resource_version_with_selectors(kube: Kube) -> None:
    kube.create(DEPLOYMENTS, deployment("w1", team="a"))
    listed = kube.request("GET", DEPLOYMENTS, labelSelector="team=a")
    assert listed["kind"] == "DeploymentList" and listed["apiVersion"] == "apps/v1"
    assert [d["metadata"]["name"] for d in listed["items"]] == ["w1"]
    since = listed["metadata"]["resourceVersion"]

    # Changes between the list and the watch must not be lost.
    kube.create(DEPLOYMENTS, deployment("w2", team="a"))
    kube.create(DEPLOYMENTS, deployment("other", team="b"))
    kube.merge(f"{DEPLOYMENTS}/w1", {"metadata": {"labels": {"team": "b"}}})

    events: list[dict[str, Any]] = []
    with kube.http.stream(
        "GET",
        DEPLOYMENTS,
        params={
            "watch": "true",
            "resourceVersion": since,
            "labelSelector": "team=a",
            "timeoutSeconds": "2",
        },
    ) as response:
        assert response.headers["content-type"].startswith("application/json")
        for line in response.iter_lines():
            events.append(json.loads(line))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "w2"),
        ("DELETED", "w1"),
    ]
    assert all(e["object"]["kind"] == "Deployment" for e in events)


def test_initial_events_end_with_a_bookmark(kube: Kube) -> None:
    kube.create(DEPLOYMENTS, deployment("init", team="i"))
    with kube.http.stream(
        "GET",
        DEPLOYMENTS,
        params={
            "watch": "1",
            "sendInitialEvents": "true",
            "allowWatchBookmarks": "true",
            "resourceVersionMatch": "NotOlderThan",
            "labelSelector": "team=i",
            "timeoutSeconds": "1",
        },
    ) as response:
        events = [json.loads(line) for line in response.iter_lines()]
    assert events[0]["type"] == "ADDED"
    assert events[1]["type"] == "BOOKMARK"
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_live_watch_and_garbage_collection(kube: Kube) -> None:
    owner = kube.create(DEPLOYMENTS, deployment("owner"))
    child = {
        "metadata": {
            "name": "owned",
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": "owner",
                    "uid": owner["metadata"]["uid"],
                }
            ],
        },
        "data": {"k": "v"},
    }
    kube.create("/api/v1/namespaces/default/configmaps", child)
    seen: list[tuple[str, str]] = []

    def watch() -> None:
        with kube.http.stream(
            "GET",
            "/api/v1/namespaces/default/configmaps",
            params={
                "watch": "true",
                "fieldSelector": "metadata.name=owned",
                "resourceVersion": owner["metadata"]["resourceVersion"],
                "timeoutSeconds": "3",
            },
        ) as response:
            for line in response.iter_lines():
                event = json.loads(line)
                seen.append((event["type"], event["object"]["metadata"]["name"]))

    watcher = threading.Thread(target=watch)
    watcher.start()
    eventually(lambda: seen, what="the replayed ADDED")
    kube.delete(f"{DEPLOYMENTS}/owner")
    eventually(lambda: ("DELETED", "owned") in seen, what="the dependent's deletion")
    watcher.join()
    assert kube.get("/api/v1/namespaces/default/configmaps/owned") is None


def test_a_dependent_created_after_its_owner_is_gone_is_collected(kube: Kube) -> None:
    """A controller that read its owner just before the owner's deletion creates a child the
    garbage collector then removes, as on a cluster."""
    owner = kube.create(DEPLOYMENTS, deployment("short-lived"))
    kube.delete(f"{DEPLOYMENTS}/short-lived")
    late = {
        "metadata": {
            "name": "late",
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": "short-lived",
                    "uid": owner["metadata"]["uid"],
                }
            ],
        },
        "data": {"k": "v"},
    }
    kube.create("/api/v1/namespaces/default/configmaps", late)
    eventually(
        lambda: kube.get("/api/v1/namespaces/default/configmaps/late") is None,
        what="the dangling dependent to be collected",
    )
    kube.create(
        "/api/v1/namespaces/default/configmaps",
        {"metadata": {"name": "unowned"}, "data": {"k": "v"}},
    )
    live = kube.create(DEPLOYMENTS, deployment("live-owner"))
    kube.create(
        "/api/v1/namespaces/default/configmaps",
        {
            **late,
            "metadata": {
                "name": "kept",
                "ownerReferences": [
                    {
                        **late["metadata"]["ownerReferences"][0],
                        "name": "live-owner",
                        "uid": live["metadata"]["uid"],
                    }
                ],
            },
        },
    )
    time.sleep(0.5)
    assert kube.get("/api/v1/namespaces/default/configmaps/unowned") is not None
    assert kube.get("/api/v1/namespaces/default/configmaps/kept") is not None


def test_finalizers_hold_deletion(kube: Kube) -> None:
    kube.create(
        DEPLOYMENTS,
        {**deployment("final"), "metadata": {"name": "final", "finalizers": ["x.io/keep"]}},
    )
    kube.delete(f"{DEPLOYMENTS}/final")
    marked = kube.get(f"{DEPLOYMENTS}/final")
    assert marked["metadata"]["deletionTimestamp"]
    kube.request(
        "PATCH",
        f"{DEPLOYMENTS}/final",
        [
            {"op": "test", "path": "/metadata/finalizers", "value": ["x.io/keep"]},
            {"op": "remove", "path": "/metadata/finalizers"},
        ],
        "application/json-patch+json",
    )
    assert kube.get(f"{DEPLOYMENTS}/final") is None


def test_custom_resources_get_defaults_scale_and_validation(kube: Kube) -> None:
    kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", load_crd())
    resources = kube.get("/apis/pagedllm.io/v1alpha1")["resources"]
    assert {
        "name": "pagedllms/scale",
        "group": "autoscaling",
        "version": "v1",
        "kind": "Scale",
    }.items() <= next(r for r in resources if r["name"] == "pagedllms/scale").items()
    path = "/apis/pagedllm.io/v1alpha1/namespaces/default/pagedllms"
    created = kube.create(path, pagedllm("cr", {"model": {"servedName": "x"}, "unknownField": 1}))
    assert created["spec"]["engine"]["blockSize"] == 16 and "unknownField" not in created["spec"]
    with pytest.raises(KubeError) as strict:
        kube.request(
            "POST",
            path,
            pagedllm("strict", {"model": {"servedName": "x"}, "unknownField": 1}),
            fieldValidation="Strict",
        )
    assert strict.value.status == 400
    with pytest.raises(KubeError) as invalid:
        kube.create(path, pagedllm("Bad-Name", {"model": {"servedName": "x"}}))
    assert invalid.value.status == 422 and "DNS-1035" in invalid.value.body["message"]

    scale = kube.merge(f"{path}/cr/scale", {"spec": {"replicas": 2}})
    assert scale["spec"]["replicas"] == 2
    assert kube.get(f"{path}/cr")["spec"]["replicas"] == 2
    table = kube.http.get(
        path, headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}
    ).json()
    assert [c["name"] for c in table["columnDefinitions"]][:5] == [
        "Name",
        "Model",
        "Ready",
        "Replicas",
        "URL",
    ]


def test_runs_standalone_with_a_kubeconfig(tmp_path: Any) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kubeconfig = tmp_path / "config"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedllm_testing.emulator",
            "--port",
            str(port),
            "--kubeconfig",
            str(kubeconfig),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert f"listening on http://127.0.0.1:{port}" in server.stdout.readline()
        assert kubeconfig.exists()
        namespaces = httpx.get(f"http://127.0.0.1:{port}/api/v1/namespaces").json()
        assert "default" in [n["metadata"]["name"] for n in namespaces["items"]]
    finally:
        server.terminate()
        assert server.wait(timeout=10) == 0


def test_requests_are_counted_by_verb_and_path(kube: Kube) -> None:
    since = kube.request("GET", "/emulator/requests")["total"]
    kube.create(DEPLOYMENTS, deployment("counted"))
    kube.get(f"{DEPLOYMENTS}/counted")
    kube.merge(f"{DEPLOYMENTS}/counted", {"spec": {"replicas": 2}})
    kube.list(DEPLOYMENTS)
    answer = kube.request("GET", "/emulator/requests", since=str(since))
    assert answer["total"] == since + 4  # reading the counts is not counted
    assert answer["counts"] == {
        f"POST {DEPLOYMENTS}": 1,
        f"GET {DEPLOYMENTS}/counted": 1,
        f"PATCH {DEPLOYMENTS}/counted": 1,
        f"GET {DEPLOYMENTS}": 1,
    }
    with pytest.raises(KubeError) as bad:
        kube.request("GET", "/emulator/requests", since="x")
    assert bad.value.status == 400
