"""The real operator against the real kube-apiserver (envtest's: no controllers, the test writes
the Deployments' and pods' statuses): what a user of `kubectl apply` sees happen."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm.operator.kube import FIELD_MANAGER
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.operator_harness import (
    KOPF_RUN,
    AuditLog,
    Kube,
    OperatorProcess,
    condition,
    deployment_path,
    eventually,
    mark_deployment_ready,
    pagedllm,
    pdb_path,
    pllm_path,
    service_path,
    wait_for_condition,
)

pytestmark = pytest.mark.usefixtures("crd", "operator_process")


def events_for(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in kube.list(f"/api/v1/namespaces/{namespace}/events")
        if e["involvedObject"]["name"] == name
    ]


def mark_routers_ready(kube: Kube, namespace: str, name: str) -> None:
    """The router Deployment's pods all ready (the Service has endpoints)."""
    eventually(lambda: kube.get(deployment_path(namespace, f"{name}-router")), what="routers")
    mark_deployment_ready(kube, namespace, f"{name}-router", ready=2)


def test_create_builds_owned_children_with_the_expected_pod(kube: Kube, namespace: str) -> None:
    """A PagedLLM becomes its owned Deployment, Service and PodDisruptionBudget, with the pod
    a hub model, GPU limits, an API key and a restricted security context call for; status
    names its URL and selector."""
    kube.create(
        f"/api/v1/namespaces/{namespace}/secrets",
        {"metadata": {"name": "llm-key"}, "stringData": {"api-key": "s3cret"}},
    )
    created = kube.create(
        pllm_path(namespace),
        pagedllm(
            "llama",
            {
                "model": {"uri": "hf://meta-llama/Llama-3.2-1B-Instruct", "servedName": "llama"},
                "replicas": 2,
                "resources": {"limits": {"nvidia.com/gpu": 1}},
                "engine": {"maxModelLen": 4096, "kvCacheMemory": "2Gi"},
                "apiKeySecretRef": {"name": "llm-key"},
                # Without routers the Service selects the serving pods themselves.
                "router": {"enabled": False},
            },
        ),
    )
    uid = created["metadata"]["uid"]

    deployment = eventually(
        lambda: kube.get(deployment_path(namespace, "llama")), what="the Deployment"
    )
    service = eventually(lambda: kube.get(service_path(namespace, "llama")), what="the Service")
    pdb = eventually(lambda: kube.get(pdb_path(namespace, "llama")), what="the PDB")
    for child in (deployment, service, pdb):
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["kind"] == "PagedLLM" and owner["controller"]

    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert container["command"] == ["pagedllm", "serve"]
    assert args[args.index("--model") + 1] == "/models/meta-llama/Llama-3.2-1B-Instruct"
    assert args[args.index("--served-model-name") + 1] == "llama"
    assert args[args.index("--max-model-len") + 1] == "4096"
    assert args[args.index("--kv-cache-memory") + 1] == str(2 * 2**30)
    assert "--enable-prefix-caching" in args
    (download,) = pod["initContainers"]
    assert download["command"] == ["pagedllm", "download"]
    assert download["args"] == [
        "hf://meta-llama/Llama-3.2-1B-Instruct",
        "/models/meta-llama/Llama-3.2-1B-Instruct",
    ]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert (
        container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"]
        >= 1800
    )
    assert container["lifecycle"]["preStop"]
    assert pod["terminationGracePeriodSeconds"] > 60
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and security["runAsNonRoot"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    api_key = next(e for e in container["env"] if e["name"] == "PAGEDLLM_API_KEY")
    assert api_key["valueFrom"]["secretKeyRef"] == {"name": "llm-key", "key": "api-key"}
    cpus = next(e for e in container["env"] if e["name"] == "PAGEDLLM_CPUS")
    assert cpus["valueFrom"]["resourceFieldRef"] == {
        "containerName": container["name"],
        "resource": "requests.cpu",
        "divisor": "1",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]

    assert service["spec"]["ports"][0]["name"] == "http"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    status = eventually(
        lambda: kube.get(pllm_path(namespace, "llama")).get("status"), what="status"
    )
    assert status["url"] == f"http://llama.{namespace}.svc:80"
    assert status["selector"] == "app.kubernetes.io/name=pagedllm,pagedllm.io/instance=llama"


def test_spec_change_updates_the_template_and_observed_generation(
    kube: Kube, namespace: str
) -> None:
    """A spec change reaches the pod template, and status.observedGeneration follows."""
    kube.create(pllm_path(namespace), pagedllm("demo", {"model": {"servedName": "demo"}}))
    eventually(lambda: kube.get(deployment_path(namespace, "demo")), what="the Deployment")
    eventually(lambda: condition(kube.get(pllm_path(namespace, "demo")), "Ready"))

    changed = kube.merge(pllm_path(namespace, "demo"), {"spec": {"engine": {"maxNumSeqs": 7}}})
    assert changed["metadata"]["generation"] == 2

    def template_updated() -> bool:
        args = kube.get(deployment_path(namespace, "demo"))["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
        return args[args.index("--max-num-seqs") + 1] == "7"

    eventually(template_updated, what="the new --max-num-seqs in the pod template")
    eventually(
        lambda: kube.get(pllm_path(namespace, "demo"))["status"].get("observedGeneration") == 2,
        what="observedGeneration 2",
    )


def test_children_deleted_by_hand_come_back(kube: Kube, namespace: str) -> None:
    """A Deployment and a Service deleted by hand are created again."""
    kube.create(pllm_path(namespace), pagedllm("demo", {"model": {"servedName": "demo"}}))
    first = eventually(lambda: kube.get(deployment_path(namespace, "demo")))
    eventually(lambda: kube.get(service_path(namespace, "demo")))

    kube.delete(deployment_path(namespace, "demo"))
    kube.delete(service_path(namespace, "demo"))

    again = eventually(
        lambda: kube.get(deployment_path(namespace, "demo")), what="the Deployment to be recreated"
    )
    assert again["metadata"]["uid"] != first["metadata"]["uid"]
    eventually(
        lambda: kube.get(service_path(namespace, "demo")), what="the Service to be recreated"
    )


def test_children_edited_by_hand_are_put_back(kube: Kube, namespace: str) -> None:
    """Edits another manager makes inside the children's keyed lists, which server-side apply
    alone would keep beside the operator's entries: a Service port changed (a second port
    named "http" would make the applied Service invalid) and an env var added to the
    serving container. Both are undone."""
    kube.create(
        pllm_path(namespace),
        pagedllm("demo", {"model": {"servedName": "demo"}, "router": {"enabled": False}}),
    )
    deployment = eventually(lambda: kube.get(deployment_path(namespace, "demo")))
    service = eventually(lambda: kube.get(service_path(namespace, "demo")))
    ports = service["spec"]["ports"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]

    kube.merge(
        service_path(namespace, "demo"),
        {"spec": {"ports": [{"name": "http", "port": ports[0]["port"] + 1}]}},
    )
    kube.request(
        "PATCH",
        deployment_path(namespace, "demo"),
        {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {"name": container["name"], "env": [{"name": "EXTRA", "value": "1"}]}
                        ]
                    }
                }
            }
        },
        "application/strategic-merge-patch+json",
    )
    eventually(
        lambda: kube.get(service_path(namespace, "demo"))["spec"]["ports"] == ports,
        what="the Service's port put back",
    )
    eventually(
        lambda: (
            kube.get(deployment_path(namespace, "demo"))["spec"]["template"]["spec"]["containers"][
                0
            ]["env"]
            == container["env"]
        ),
        what="the extra env var gone",
    )


def test_readiness_flows_from_deployment_to_the_ready_condition(kube: Kube, namespace: str) -> None:
    """The Deployment's readyReplicas (written by the test, as the Deployment controller
    would) become the Ready condition: 1/2, then Ready once the routers are ready too."""
    kube.create(
        pllm_path(namespace), pagedllm("demo", {"model": {"servedName": "demo"}, "replicas": 2})
    )
    eventually(lambda: kube.get(deployment_path(namespace, "demo")))
    not_ready = eventually(lambda: condition(kube.get(pllm_path(namespace, "demo")), "Ready"))
    assert not_ready["status"] == "False"

    mark_deployment_ready(kube, namespace, "demo", ready=1)
    eventually(
        lambda: (
            condition(kube.get(pllm_path(namespace, "demo")), "Ready").get("message")
            == "1/2 replicas ready"
        ),
        what="1/2 ready",
    )
    mark_routers_ready(kube, namespace, "demo")
    mark_deployment_ready(kube, namespace, "demo", ready=2)
    ready = wait_for_condition(kube, namespace, "demo", "Ready", "Ready=True", status="True")
    assert ready["reason"] == "AllReplicasReady"
    live = kube.get(pllm_path(namespace, "demo"))
    assert live["status"]["readyReplicas"] == 2
    assert condition(live, "Progressing")["reason"] == "Complete"
    assert condition(live, "Degraded")["status"] == "False"


def test_scale_subresource_drives_deployment_replicas(kube: Kube, namespace: str) -> None:
    """Writing /scale sets the Deployment's replicas; a PDB exists with more than one replica
    only."""
    kube.create(pllm_path(namespace), pagedllm("demo", {"model": {"servedName": "demo"}}))
    eventually(lambda: kube.get(deployment_path(namespace, "demo")))
    assert kube.get(pdb_path(namespace, "demo")) is None

    scale = kube.merge(pllm_path(namespace, "demo", "scale"), {"spec": {"replicas": 3}})
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    eventually(
        lambda: kube.get(deployment_path(namespace, "demo"))["spec"]["replicas"] == 3,
        what="Deployment replicas 3",
    )
    eventually(lambda: kube.get(pdb_path(namespace, "demo")), what="a PDB for 3 replicas")
    scale = kube.get(pllm_path(namespace, "demo", "scale"))
    assert (
        scale["status"]["selector"] == "app.kubernetes.io/name=pagedllm,pagedllm.io/instance=demo"
    )

    kube.merge(pllm_path(namespace, "demo", "scale"), {"spec": {"replicas": 1}})
    eventually(lambda: kube.get(deployment_path(namespace, "demo"))["spec"]["replicas"] == 1)
    eventually(
        lambda: kube.get(pdb_path(namespace, "demo")) is None, what="the PDB to go with one replica"
    )


def test_bad_spec_degrades_only_that_resource_and_recovers(kube: Kube, namespace: str) -> None:
    """A PagedLLM naming a missing claim is Degraded with a Warning Event while another one is
    served; once the claim exists, the retry serves it too."""
    kube.create(
        pllm_path(namespace),
        pagedllm("broken", {"model": {"uri": "pvc://weights/llama", "servedName": "llama"}}),
    )
    kube.create(pllm_path(namespace), pagedllm("healthy", {"model": {"servedName": "demo"}}))

    degraded = wait_for_condition(
        kube, namespace, "broken", "Degraded", "Degraded on the broken resource", status="True"
    )
    assert degraded["reason"] == "InvalidSpec"
    assert 'PersistentVolumeClaim "weights"' in degraded["message"]
    eventually(
        lambda: any(
            e["reason"] == "InvalidSpec" and "weights" in e["message"]
            for e in events_for(kube, namespace, "broken")
        ),
        what="a Warning event",
    )
    assert kube.get(deployment_path(namespace, "broken")) is None

    eventually(
        lambda: kube.get(deployment_path(namespace, "healthy")),
        what="the healthy resource to be served regardless",
    )
    mark_deployment_ready(kube, namespace, "healthy", ready=1)
    mark_routers_ready(kube, namespace, "healthy")
    eventually(
        lambda: (
            condition(kube.get(pllm_path(namespace, "healthy")), "Ready").get("status") == "True"
        ),
        what="the healthy resource Ready",
    )

    # Retried with backoff: once the claim exists, the resource heals by itself.
    kube.create(
        f"/api/v1/namespaces/{namespace}/persistentvolumeclaims",
        {
            "metadata": {"name": "weights"},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    deployment = eventually(
        lambda: kube.get(deployment_path(namespace, "broken")),
        timeout=15,
        what="the retry to create the Deployment",
    )
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in volumes
    eventually(
        lambda: (
            condition(kube.get(pllm_path(namespace, "broken")), "Degraded").get("status") == "False"
        ),
        what="Degraded cleared",
    )


def add_pod(kube: Kube, namespace: str, name: str, owner: str, status: dict[str, Any]) -> None:
    """A pod of `owner` in the state the kubelet would report."""
    pods = f"/api/v1/namespaces/{namespace}/pods"
    kube.create(
        pods,
        {
            "metadata": {
                "name": name,
                "labels": {"app.kubernetes.io/name": "pagedllm", "pagedllm.io/instance": owner},
            },
            "spec": {"containers": [{"name": "pagedllm", "image": "x"}]},
        },
    )
    kube.merge(f"{pods}/{name}/status", {"status": status})


def test_pod_problems_surface_as_conditions(kube: Kube, namespace: str) -> None:
    """An unschedulable pod shows as Progressing WaitingForCapacity, a crash-looping one as
    Degraded with a Warning Event (pods' statuses written by the test, as the scheduler and
    the kubelet would)."""
    kube.create(
        pllm_path(namespace), pagedllm("demo", {"model": {"servedName": "demo"}, "replicas": 2})
    )
    eventually(lambda: kube.get(deployment_path(namespace, "demo")))
    add_pod(
        kube,
        namespace,
        "demo-pending",
        "demo",
        {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                }
            ],
        },
    )
    waiting = wait_for_condition(
        kube, namespace, "demo", "Progressing", "WaitingForCapacity", reason="WaitingForCapacity"
    )
    assert "Insufficient nvidia.com/gpu" in waiting["message"]
    assert condition(kube.get(pllm_path(namespace, "demo")), "Degraded")["status"] == "False"

    add_pod(
        kube,
        namespace,
        "demo-crashing",
        "demo",
        {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "pagedllm",
                    "ready": False,
                    "restartCount": 4,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                    "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
                }
            ],
        },
    )
    degraded = wait_for_condition(kube, namespace, "demo", "Degraded", "Degraded", status="True")
    assert degraded["reason"] == "CrashLoopBackOff"
    assert "demo-crashing" in degraded["message"] and "exit code 1" in degraded["message"]
    eventually(
        lambda: any(e["reason"] == "CrashLoopBackOff" for e in events_for(kube, namespace, "demo")),
        what="an Event",
    )


def test_hpa_mode_targets_the_scale_subresource(kube: Kube, namespace: str) -> None:
    """Autoscaling mode hpa makes an HPA on the PagedLLM's /scale with the KV-cache metric;
    /scale written (as the HPA would) moves the Deployment, and the HPA goes with autoscaling."""
    kube.create(
        pllm_path(namespace),
        pagedllm(
            "demo",
            {
                "model": {"servedName": "demo"},
                "autoscaling": {
                    "minReplicas": 1,
                    "maxReplicas": 4,
                    "target": 0.8,
                    "metric": "kvCacheUsage",
                    "mode": "hpa",
                    "scaleDownDelaySeconds": 120,
                },
            },
        ),
    )
    hpa_path = f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/demo"
    hpa = eventually(lambda: kube.get(hpa_path), what="the HPA")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "pagedllm.io/v1alpha1",
        "kind": "PagedLLM",
        "name": "demo",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "vllm_kv_cache_usage_perc"
    assert metric["pods"]["target"]["averageValue"] == "800m"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120

    # What the HPA does: write /scale. The Deployment follows.
    kube.merge(pllm_path(namespace, "demo", "scale"), {"spec": {"replicas": 3}})
    eventually(lambda: kube.get(deployment_path(namespace, "demo"))["spec"]["replicas"] == 3)

    kube.merge(pllm_path(namespace, "demo"), {"spec": {"autoscaling": None, "replicas": 1}})
    eventually(lambda: kube.get(hpa_path) is None, what="the HPA to go without autoscaling")


def resyncs_of(audit: AuditLog, namespace: str) -> int:
    """How many resyncs of `namespace` the operator began since `audit` was made: each lists
    the namespace's Deployments once."""
    return sum(
        1
        for e in audit.read()
        if e["userAgent"] == FIELD_MANAGER
        and e["verb"] == "list"
        and e.get("objectRef", {}).get("resource") == "deployments"
        and e["objectRef"].get("namespace") == namespace
    )


def test_restart_duplicates_nothing(
    cluster: ControlPlane,
    kube: Kube,
    namespace: str,
    kubeconfig: Any,
    operator_process: OperatorProcess,
    tmp_path: Any,
) -> None:
    """A second operator process takes over the first one's children: after its resumed
    reconcile and two resyncs of the namespace, every child is the one the first made, and
    no kopf annotation or finalizer was left on the PagedLLM."""
    kube.create(
        pllm_path(namespace), pagedllm("demo", {"model": {"servedName": "demo"}, "replicas": 2})
    )
    eventually(lambda: kube.get(deployment_path(namespace, "demo-router")), what="routers")
    before = {
        "deployment": eventually(lambda: kube.get(deployment_path(namespace, "demo"))),
        "service": eventually(lambda: kube.get(service_path(namespace, "demo"))),
        "pdb": eventually(lambda: kube.get(pdb_path(namespace, "demo"))),
        "routers": kube.get(deployment_path(namespace, "demo-router")),
    }
    assert operator_process.stop() == 0

    # The second run goes through `pagedllm.operator.run`, the `pagedllm operator` entry.
    entry = [
        KOPF_RUN[0],
        "-c",
        "import sys; from pagedllm.operator import run; sys.exit(run(sys.argv[1:]))",
    ]
    second = OperatorProcess(kubeconfig, tmp_path, entry)
    second.start()
    try:
        eventually(
            lambda: "Handler 'reconcile_pagedllm' succeeded" in second.log(),
            what="the resumed reconcile",
        )
        audit = AuditLog(cluster)
        eventually(lambda: resyncs_of(audit, namespace) >= 2, what="two resyncs of the namespace")
        deployments = kube.list(deployment_path(namespace))
        assert sorted(d["metadata"]["uid"] for d in deployments) == sorted(
            [before["deployment"]["metadata"]["uid"], before["routers"]["metadata"]["uid"]]
        )
        assert (
            kube.get(service_path(namespace, "demo"))["metadata"]["uid"]
            == before["service"]["metadata"]["uid"]
        )
        assert (
            kube.get(pdb_path(namespace, "demo"))["metadata"]["uid"]
            == before["pdb"]["metadata"]["uid"]
        )
        annotations = kube.get(pllm_path(namespace, "demo"))["metadata"]["annotations"]
        assert all(not key.startswith("kopf.zalando.org") for key in annotations)
        assert not kube.get(pllm_path(namespace, "demo"))["metadata"].get("finalizers")
    finally:
        second.stop()
        operator_process.start()
