"""The user's whole journey, end to end, on the local cluster (local_cluster.py: the real
control plane, process kubelets): apply the operator's manifests (the operator runs as a pod
with its own ServiceAccount) and a PagedLLM with kubectl, wait for it, use it through its
Service (the prefix-aware routers in front of the serving pods) with the openai SDK and through
the apiserver's service proxy, scale it, roll out a new engine setting while a client streams,
kill a router under load, outgrow the cluster's GPU nodes (pods wait for the cluster autoscaler
stand-in's node) and shrink them again (a node drained through the Eviction API under the
PodDisruptionBudget), let it autoscale on queue depth, delete it. Every step prints its
duration; a failure prints the objects, the components' and the pods' logs.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pagedllm.operator.autoscaler import parse_prometheus_value
from pagedllm.operator.kube import FIELD_MANAGER
from pagedllm.router.discovery import USER_AGENT as ROUTER_AGENT
from pagedllm_testing.client_checks import MAX_TOKENS, KeepStreaming, Load, StreamStats, run_checks
from pagedllm_testing.client_checks import client as openai_client
from pagedllm_testing.cluster.kubelet.node import now
from pagedllm_testing.cluster_autoscaler_standin import (
    ClusterAutoscalerStandin,
    NodeGroup,
    Timers,
    is_terminating,
    node_gpus,
)
from pagedllm_testing.gitops_standin import GitOpsStandin
from pagedllm_testing.local_cluster import (
    FAST_OPERATOR_ENV,
    GPU_GROUP,
    NAMESPACE,
    OPERATOR,
    OPERATOR_NAMESPACE,
    REPO,
    LocalCluster,
    eventually,
    is_pod_ready,
    local_url,
)

SCENARIO = REPO / "e2e" / "demo-pagedllm.yaml"
NAME = "demo"
MODEL = "demo"
# The serving pods, the routers, and everything the PagedLLM owns.
SELECTOR = f"app.kubernetes.io/name=pagedllm,pagedllm.io/instance={NAME}"
ROUTER_SELECTOR = f"app.kubernetes.io/name=pagedllm-router,pagedllm.io/instance={NAME}"
INSTANCE_SELECTOR = f"pagedllm.io/instance={NAME}"
ROUTERS = 2
PLLM = f"/apis/pagedllm.io/v1alpha1/namespaces/{NAMESPACE}/pagedllms/{NAME}"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
# The autoscaling phase: a batch of two makes queue depth easy to reach on the demo model.
ROLLOUT_MAX_NUM_SEQS = 2
QUIET_RESYNCS = 3
# The operator's User-Agents: its own API client's and kopf's (watches, its own patches).
OPERATOR_AGENTS = (FIELD_MANAGER, "kopf/")
# Scale to zero when idle, and back from zero on the next request (held by the routers).
AUTOSCALING = {
    "minReplicas": 0,
    "maxReplicas": 3,
    "metric": "waitingRequests",
    "target": 2,
    "scaleDownDelaySeconds": 10,
}
LOAD_CLIENTS = 8
# Longer than a stopping pod's preStop pause on the demo model.
LONG_STREAM_TOKENS = 600
# A router that dies stays in its Service until the kubelet has seen the exit and the
# endpoints follow (under a second here on an idle machine, more under load, 1-2 s in a real
# cluster); a connection sent to it meanwhile is refused. The openai SDK's default two retries
# of connection errors span only 1.1-1.5 s; four span 5.6-7.5 s, what the documentation
# (docs/kubernetes/routers.md) tells clients of a fleet to set.
CRASH_RETRIES = 4
# The cluster autoscaler's node group: 3-GPU nodes (the cluster starts with 1-GPU ones), at
# least one; a pod waits 4 s before a node is added (long enough to see it wait), a node is
# spare 2 s before it goes.
NODE_GROUP = NodeGroup(GPU_GROUP, gpus_per_node=3, min_nodes=1, max_nodes=3)
NODE_TIMERS = Timers(scale_up_delay=4, scale_down_delay=2, eviction_retry=1)
# Short prompts (under one KV block) that are cached nowhere: the router places each by a
# hash of its tokens, which spreads distinct prompts over the pods.
SPREAD_PROMPTS = 24
POD_TEMPLATE_HASH = "pod-template-hash"
METRICS_ADAPTER = REPO / "e2e" / "custom-metrics-adapter.yaml"
METRICS_API_SERVICE = "v1beta2.custom.metrics.k8s.io"
HPA = f"/apis/autoscaling/v2/namespaces/{NAMESPACE}/horizontalpodautoscalers/{NAME}"
HPA_METRIC = "vllm_num_requests_waiting"
HPA_USER = "system:serviceaccount:kube-system:horizontal-pod-autoscaler"
# The audit log's verbs that change something.
MUTATING_VERBS = ("create", "update", "patch", "delete", "deletecollection")
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR}"
ROUTER_USER = f"system:serviceaccount:{NAMESPACE}:{NAME}-router"


class Steps:
    """Prints each step with its duration as it happens (past pytest's output capture)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]):
        self.capsys = capsys
        self.durations: list[tuple[str, float]] = []
        self.started = time.monotonic()

    def say(self, line: str) -> None:
        with self.capsys.disabled():
            print(line, flush=True)

    @contextmanager
    def __call__(self, title: str) -> Iterator[None]:
        self.say(f"\n-> {title}")
        started = time.monotonic()
        try:
            yield
        finally:
            elapsed = time.monotonic() - started
            self.durations.append((title, elapsed))
            self.say(f"   {elapsed:6.1f}s  {title}")

    def summary(self) -> str:
        lines = [f"{seconds:7.1f}s  {title}" for title, seconds in self.durations]
        lines.append(f"{time.monotonic() - self.started:7.1f}s  total")
        return "\n".join(lines)


def pods(cluster: LocalCluster) -> list[dict[str, Any]]:
    return cluster.list(PODS, SELECTOR)


def serving_pods(cluster: LocalCluster) -> list[dict[str, Any]]:
    return [p for p in pods(cluster) if is_pod_ready(p)]


def routers(cluster: LocalCluster) -> list[dict[str, Any]]:
    return cluster.list(PODS, ROUTER_SELECTOR)


def ready_routers(cluster: LocalCluster) -> list[dict[str, Any]]:
    return [p for p in routers(cluster) if is_pod_ready(p)]


def pagedllm(cluster: LocalCluster) -> dict[str, Any]:
    body = cluster.get(PLLM)
    assert body is not None, "the PagedLLM is gone"
    return body


def condition(body: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(
        (c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == kind), {}
    )


def pod_metric(pod: dict[str, Any], name: str) -> float:
    """A metric from the pod's own /metrics (at its address)."""
    text = httpx.get(f"{local_url(pod)}/metrics", timeout=5, trust_env=False).text
    return parse_prometheus_value(text, name) or 0.0


def engine_flag(pod: dict[str, Any], flag: str) -> str:
    args = pod["spec"]["containers"][0]["args"]
    return args[args.index(flag) + 1]


def ready_with(cluster: LocalCluster, replicas: int) -> dict[str, Any] | None:
    """The PagedLLM once it is Ready with exactly `replicas` serving pods and no others, and
    all its routers ready."""
    body = pagedllm(cluster)
    status = body.get("status") or {}
    if (
        status.get("observedGeneration") == body["metadata"]["generation"]
        and condition(body, "Ready").get("status") == "True"
        and condition(body, "Router").get("status") == "True"
        and status.get("readyReplicas") == replicas
        and len(serving_pods(cluster)) == replicas == len(pods(cluster))
    ):
        return body
    return None


# The scenario takes about seven minutes on two shared cores; a hung step fails well before
# the suite's own limit, still printing what explains it.
@pytest.mark.timeout(780)
def test_user_journey(capsys: pytest.CaptureFixture[str]) -> None:
    # Short: the node's unix sockets live under the pods' directories.
    workdir = Path(tempfile.mkdtemp(prefix="pllm-e2e-"))
    cluster = LocalCluster(workdir)
    steps = Steps(capsys)
    steps.say(f"\nlocal cluster in {workdir}")
    try:
        journey(cluster, steps)
    except BaseException:
        print(cluster.diagnostics())
        raise
    finally:
        with steps("stop everything the scenario started"):
            cluster.stop()
            left = cluster.live_processes()
        steps.say("\n" + steps.summary())
    assert not left, f"processes left behind: {left}"
    shutil.rmtree(workdir)  # kept when the scenario fails, for its logs


def journey(cluster: LocalCluster, steps: Steps) -> None:
    with steps(
        "start the control plane (etcd, kube-apiserver, kube-controller-manager, "
        f"kube-scheduler) and {1 + cluster.shape.gpu_nodes} process kubelets, Nodes Ready"
    ):
        cluster.start()

    with steps("kubectl apply -k manifests/ (namespace, CRD, RBAC, operator Deployment)"):
        cluster.kubectl("apply", "-k", str(REPO / "manifests"))
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/pagedllms.pagedllm.io", "--timeout=30s"
        )

    with steps("the operator pod, with short timers (kubectl set env), rolled out and ready"):
        cluster.start_operator()

    with steps(f"kubectl apply a PagedLLM: demo model, 2 replicas, {ROUTERS} routers, 1 GPU a pod"):
        manifest = cluster.workdir / "demo-pagedllm.yaml"
        manifest.write_text(yaml.safe_dump(scenario_manifest()))
        cluster.kubectl("apply", "-f", str(manifest))

    with steps("kubectl wait --for=condition=Ready pllm/demo"):
        cluster.kubectl(
            "wait", "--for=condition=Ready", f"pllm/{NAME}", "--timeout=180s", timeout=200
        )
        cluster.kubectl(
            "wait", "--for=condition=Router", f"pllm/{NAME}", "--timeout=120s", timeout=140
        )
        eventually(lambda: ready_with(cluster, 2), timeout=30, what="2 serving pods")
        everything = cluster.list(PODS, INSTANCE_SELECTOR)
        assert len(everything) == 2 + ROUTERS
        running = set(cluster.pod_processes()) - system_pods(cluster)
        assert running == {p["metadata"]["name"] for p in everything}
        steps.say(cluster.kubectl("get", "pllm,deploy,pods,svc", "-o", "wide"))
        eventually(
            lambda: routers_follow_the_pods(cluster), timeout=30, what="routers to see the pods"
        )
        # The Service moved to the routers once one was ready.
        eventually(
            lambda: (
                "pagedllm-router"
                in cluster.kubectl("get", "svc", NAME, "-o", "jsonpath={.spec.selector}")
            ),
            timeout=30,
            what="the Service to select the routers",
        )

    base_url = cluster.service_url(NAME) + "/v1"
    with steps("completions and chat, streaming and not, through the Service (the routers)"):
        run_checks(base_url, MODEL, log=steps.say)

    with steps("a completion through the apiserver's service proxy (services/demo:http/proxy)"):
        through_the_apiserver(cluster, steps)

    with steps("kubectl scale pllm/demo --replicas=3; three ready pods serve"):
        cluster.kubectl("scale", f"pllm/{NAME}", "--replicas=3")
        cluster.kubectl(
            "wait",
            "--for=jsonpath={.status.readyReplicas}=3",
            f"pllm/{NAME}",
            "--timeout=180s",
            timeout=200,
        )
        cluster.kubectl("wait", "--for=condition=Ready", f"pllm/{NAME}", "--timeout=60s")
        eventually(lambda: ready_with(cluster, 3), timeout=30, what="3 serving pods")
        eventually(
            lambda: routers_follow_the_pods(cluster), timeout=30, what="routers to see 3 pods"
        )
        every_pod_answers(cluster, base_url)

    with steps(
        f"at steady state, over {QUIET_RESYNCS} resyncs: no mutating request by the operator "
        "(the apiserver's audit log)"
    ):
        operator_is_quiet(cluster, steps)

    with steps(
        f"change spec.engine.maxNumSeqs to {ROLLOUT_MAX_NUM_SEQS}: a rolling update "
        "while a client keeps streaming"
    ):
        rolling_update(cluster, base_url, steps)

    with steps(
        "kill a router pod (SIGKILL) while clients stream: none fails before its stream opened"
    ):
        kill_a_router(cluster, base_url, steps)

    # Argo CD or Flux re-applying the repository's manifest all through the cluster's and the
    # PagedLLM's autoscaling.
    gitops_runs: list[GitOpsStandin] = []
    with gitops_standin(cluster, autoscaling=False) as gitops:
        gitops_runs.append(gitops)
        finite_capacity(cluster, base_url, steps)

    gitops_runs.append(operator_autoscaling(cluster, base_url, steps))
    hpa_autoscaling(cluster, base_url, steps)

    with steps(
        "GitOps stand-in (server-side apply, own field manager, no spec.replicas) meanwhile"
    ):
        for run in gitops_runs:
            stats = run.stats
            steps.say(
                f"   {stats.applies} applies, {stats.raced} alongside a replicas write; "
                "PagedLLM and Deployment generations and replicas never moved by an apply"
            )
            assert not stats.problems, stats.problems
            assert stats.applies - stats.raced >= 3, stats

    with steps("kubectl delete pllm/demo: pods, routers and Services gone, no process left"):
        cluster.kubectl("delete", "pllm", NAME, "--timeout=60s")
        cluster.kubectl(
            "wait", "--for=delete", "pod", "-l", INSTANCE_SELECTOR, "--timeout=120s", timeout=140
        )
        # The garbage collector also removes what a reconcile in flight created just after.
        eventually(
            lambda: (
                "No resources found"
                in cluster.kubectl(
                    "get",
                    "deploy,rs,svc,pdb,hpa,pods,sa,role,rolebinding",
                    "-l",
                    INSTANCE_SELECTOR,
                )
            ),
            timeout=30,
            what="the PagedLLM's children to be gone",
        )
        eventually(
            lambda: set(cluster.pod_processes()) <= system_pods(cluster),
            timeout=30,
            what="every pod process but the operator's and the metrics adapter's to exit",
        )

    with steps("the audit log: the operator's and the routers' requests, all as their accounts"):
        requests_by_service_accounts(cluster, steps)


def operator_autoscaling(cluster: LocalCluster, base_url: str, steps: Steps) -> GitOpsStandin:
    """The built-in autoscaler from zero to three and back, with the GitOps stand-in
    re-applying the manifest all along (returned, for its findings)."""
    with ExitStack() as during_autoscaling:
        with steps("autoscaling (min 0, max 3, waitingRequests): idle, it scales to zero"):
            patch_spec(cluster, {"autoscaling": AUTOSCALING})
            gitops = during_autoscaling.enter_context(gitops_standin(cluster))
            eventually(lambda: scaled_to_zero(cluster), timeout=90, what="zero replicas")
            steps.say(f"   {latest_event(cluster, 'ScaledDown')}")

        with steps(
            "at zero, a stream through the Service is held by a router, a pod starts, it completes"
        ):
            held_stream_wakes_it(cluster, base_url, steps)

        with steps(
            f"a load generator ({LOAD_CLIENTS} streaming clients) raises queue depth: replicas grow"
        ):
            with Load(base_url, MODEL, LOAD_CLIENTS) as load:
                eventually(
                    lambda: pagedllm(cluster)["spec"]["replicas"] > 1,
                    timeout=60,
                    what="the autoscaler to scale up",
                )
                steps.say(f"   {latest_event(cluster, 'ScaledUp')}")
                grown = eventually(
                    lambda: scaled_up_and_serving(cluster),
                    timeout=150,
                    what="the added replicas to serve",
                )
                steps.say(f"   {grown} replicas serve")
            assert load.stats.requests > 0

        with steps("load stops: back to zero after scaleDownDelaySeconds"):
            eventually(lambda: scaled_to_zero(cluster), timeout=120, what="back to zero")
            steps.say(f"   {latest_event(cluster, 'ScaledDown')}")
    return gitops


def scenario_manifest() -> dict[str, Any]:
    """The scenario's PagedLLM asking one GPU a serving pod, as on a GPU cluster (the process
    kubelet's GPU nodes run them on the CPU): the real scheduler places them by it."""
    manifest = yaml.safe_load(SCENARIO.read_text())
    manifest["spec"]["resources"].setdefault("limits", {})["nvidia.com/gpu"] = 1
    return manifest


def system_pods(cluster: LocalCluster) -> set[str]:
    """The pods of other namespaces than the PagedLLM's: the operator, the metrics adapter."""
    pods = cluster.list("/api/v1/pods")
    return {p["metadata"]["name"] for p in pods if p["metadata"]["namespace"] != NAMESPACE}


def gitops_standin(cluster: LocalCluster, autoscaling: bool = True) -> GitOpsStandin:
    control_plane = cluster.control_plane
    return GitOpsStandin(
        cluster.server,
        NAMESPACE,
        repository_manifest(autoscaling),
        verify=control_plane.ssl_context(control_plane.admin),
    )


def through_the_apiserver(cluster: LocalCluster, steps: Steps) -> None:
    """One completion sent to the Service by the apiserver (its service proxy dials an
    endpoint of the Service: a router)."""
    control_plane = cluster.control_plane
    response = httpx.post(
        f"{cluster.apiserver_proxy_url(NAME)}/v1/completions",
        json={"model": MODEL, "prompt": "Hello through the apiserver", "max_tokens": 8},
        verify=control_plane.ssl_context(control_plane.admin),
        timeout=60,
        trust_env=False,
    )
    response.raise_for_status()
    body = response.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length"), body
    steps.say(f"   {body['usage']['completion_tokens']} tokens: {body['choices'][0]['text']!r}")


def audit_after(cluster: LocalCluster, since: str) -> list[dict[str, Any]]:
    return [e for e in cluster.audit_events() if e.get("requestReceivedTimestamp", "") >= since]


def hpa_autoscaling(cluster: LocalCluster, base_url: str, steps: Steps) -> None:
    """`mode: hpa`: the operator makes an HPA over the PagedLLM's /scale, and the real HPA
    controller scales it on the waiting requests it reads through the custom-metrics API (the
    tests' adapter stand-in, registered as an APIService)."""
    with steps(
        "mode: hpa (min 1): a custom-metrics adapter (stand-in) registered as an APIService, "
        "the operator's HPA active on vllm_num_requests_waiting"
    ):
        cluster.kubectl("apply", "-f", str(METRICS_ADAPTER))
        cluster.kubectl(
            "wait",
            "--for=condition=Available",
            f"apiservice/{METRICS_API_SERVICE}",
            "--timeout=120s",
            timeout=140,
        )
        patch_spec(cluster, {"autoscaling": {**AUTOSCALING, "mode": "hpa", "minReplicas": 1}})
        # The HPA leaves a target at zero alone: one replica to start from.
        cluster.kubectl("scale", f"pllm/{NAME}", "--replicas=1")
        eventually(lambda: ready_with(cluster, 1), timeout=120, what="1 replica serving")
        values = eventually(lambda: custom_metric(cluster), timeout=30, what="the custom metric")
        steps.say(f"   {HPA_METRIC} per pod through the aggregation layer: {values}")
        active = eventually(
            lambda: (
                hpa_condition(cluster, "ScalingActive").get("status") == "True"
                and hpa_condition(cluster, "ScalingActive")
            ),
            timeout=60,
            what="the HPA to read the metric",
        )
        steps.say(f"   ScalingActive: {active.get('message')}")

    since = now(micro=True)
    with steps("the load generator again: the HPA controller scales /scale up (target 2 a pod)"):
        with Load(base_url, MODEL, LOAD_CLIENTS) as load:
            eventually(
                lambda: pagedllm(cluster)["spec"]["replicas"] > 1,
                timeout=90,
                what="the HPA to scale up",
            )
            grown = eventually(
                lambda: scaled_up_and_serving(cluster),
                timeout=150,
                what="the added replicas to serve",
            )
            hpa = cluster.get(HPA)
            assert hpa is not None
            steps.say(
                f"   {grown} replicas serve; HPA current metrics "
                f"{json.dumps(hpa['status'].get('currentMetrics'))}"
            )
        assert load.stats.requests > 0
        scalers = {
            e["user"]["username"]
            for e in audit_after(cluster, since)
            if e["verb"] in ("update", "patch")
            and e.get("objectRef", {}).get("resource") == "pagedllms"
            and e["objectRef"].get("subresource") == "scale"
        }
        steps.say(f"   /scale written by {', '.join(sorted(scalers))}")
        assert HPA_USER in scalers, scalers
        assert OPERATOR_USER not in scalers, "the operator scaled in HPA mode"

    with steps("load stops: the HPA scales back to minReplicas 1"):
        eventually(lambda: ready_with(cluster, 1), timeout=120, what="back to 1 replica")


def custom_metric(cluster: LocalCluster) -> dict[str, str] | None:
    """Pod -> value of the HPA's metric, as the custom-metrics API serves it."""
    selector = urllib.parse.quote(SELECTOR)
    path = f"/apis/custom.metrics.k8s.io/v1beta2/namespaces/{NAMESPACE}/pods/*/{HPA_METRIC}"
    listed = cluster.get(f"{path}?labelSelector={selector}")
    items = (listed or {}).get("items") or []
    return {i["describedObject"]["name"]: i["value"] for i in items} or None


def hpa_condition(cluster: LocalCluster, kind: str) -> dict[str, Any]:
    hpa = cluster.get(HPA) or {}
    return condition(hpa, kind)


def operator_is_quiet(cluster: LocalCluster, steps: Steps) -> None:
    """The operator's requests (its own client's and kopf's) over a few resyncs of a settled
    PagedLLM, from the apiserver's audit log: reads only."""
    since = now(micro=True)
    time.sleep(QUIET_RESYNCS * float(FAST_OPERATOR_ENV["PAGEDLLM_OPERATOR_RESYNC_SECONDS"]) + 1)
    seen = [e for e in audit_after(cluster, since) if e["user"]["username"] == OPERATOR_USER]
    writes = [f"{e['verb']} {e['requestURI']}" for e in seen if e["verb"] in MUTATING_VERBS]
    reads = len(seen) - len(writes)
    steps.say(f"   the operator: {reads} reads, {len(writes)} writes")
    assert reads >= QUIET_RESYNCS, f"the operator did not resync: {len(seen)} requests"
    assert not writes, f"the operator wrote at steady state: {writes}"


def requests_by_service_accounts(cluster: LocalCluster, steps: Steps) -> None:
    """Every request the operator's and the routers' clients made (kopf's, the operator's own
    client's, the routers' discovery and waker) reached the apiserver as their
    ServiceAccounts, none as the admin user; both did reach it."""
    events = cluster.audit_events()
    agents = (*OPERATOR_AGENTS, ROUTER_AGENT)
    ours = [e for e in events if e.get("userAgent", "").startswith(agents)]
    # A request whose token the apiserver no longer takes (a bound token of a pod just
    # deleted) is refused as no one: 401, no user.
    refused = [e for e in ours if "username" not in e["user"]]
    assert all(e["responseStatus"]["code"] == 401 for e in refused), refused
    users = {e["user"]["username"] for e in ours if e not in refused}
    steps.say(
        f"   {len(ours)} requests by {', '.join(sorted(users))} "
        f"({len(refused)} refused as unauthenticated)"
    )
    assert users <= {OPERATOR_USER, ROUTER_USER}, users
    by_user = {
        u: sum(e["user"].get("username") == u for e in events) for u in (OPERATOR_USER, ROUTER_USER)
    }
    assert all(by_user.values()), by_user


def patch_spec(cluster: LocalCluster, spec: dict[str, Any]) -> None:
    """`kubectl patch --type=merge` of the PagedLLM's spec, as a user changes it."""
    cluster.kubectl("patch", "pllm", NAME, "--type=merge", "-p", json.dumps({"spec": spec}))


def repository_manifest(autoscaling: bool = True) -> dict[str, Any]:
    """The PagedLLM as a GitOps repository holds it by now: the scenario's manifest with the
    engine setting (and autoscaling) the steps before added (the stand-in drops
    spec.replicas)."""
    manifest = yaml.safe_load(SCENARIO.read_text())
    manifest["metadata"]["namespace"] = NAMESPACE
    manifest["spec"]["engine"]["maxNumSeqs"] = ROLLOUT_MAX_NUM_SEQS
    if autoscaling:
        manifest["spec"]["autoscaling"] = AUTOSCALING
    return manifest


def gpu_capacity(cluster: LocalCluster) -> int:
    """GPUs of the schedulable GPU nodes, all together."""
    return sum(
        node_gpus(node)
        for node in cluster.gpu_nodes()
        if not (node.get("spec") or {}).get("unschedulable")
    )


def nodes_line(cluster: LocalCluster) -> str:
    nodes = cluster.gpu_nodes()
    return ", ".join(f"{n['metadata']['name']} ({node_gpus(n)} GPU)" for n in nodes)


def finite_capacity(cluster: LocalCluster, base_url: str, steps: Steps) -> None:
    """The cluster autoscaler stand-in over GPU nodes: pods wait for capacity, a node comes,
    and the node that became spare is drained through the Eviction API under the
    PodDisruptionBudget, while clients stream."""
    autoscaler = cluster.start_cluster_autoscaler(NODE_GROUP, NODE_TIMERS)
    with steps(
        "cluster-autoscaler stand-in on; kubectl scale pllm/demo --replicas=1: "
        "emptied GPU nodes removed, capacity for one pod left"
    ):
        cluster.kubectl("scale", f"pllm/{NAME}", "--replicas=1")
        eventually(lambda: ready_with(cluster, 1), timeout=60, what="1 serving pod")
        eventually(lambda: gpu_capacity(cluster) == 1, timeout=60, what="the spare GPU nodes to go")
        steps.say(f"   GPU nodes: {nodes_line(cluster)}; removed {autoscaler.stats.removed}")

    # Short streams back to back and long ones that outlast a stopping pod's preStop pause,
    # through both steps: some are running on the pod that the drain evicts.
    with ExitStack() as streaming:
        short = streaming.enter_context(KeepStreaming(base_url, MODEL))
        long = streaming.enter_context(
            KeepStreaming(base_url, MODEL, max_tokens=LONG_STREAM_TOKENS, ignore_eos=True)
        )
        with steps(
            "with capacity for one pod only, kubectl scale --replicas=3 while clients stream: "
            "two pods Pending/Unschedulable, Progressing/WaitingForCapacity (not Degraded), a "
            "node added, all 3 Ready"
        ):
            outgrow_the_nodes(cluster, autoscaler, steps)
        with steps(
            "the cluster scales down: the 1-GPU node drained through the Eviction API, held by "
            "the PDB until the new pods were ready, then removed; no stream fails"
        ):
            drain_the_small_node(cluster, autoscaler, steps)
            streaming.close()
            none_failed(steps, "through both steps", short.stats, long.stats)


def none_failed(steps: Steps, when: str, short: StreamStats, long: StreamStats) -> None:
    """The short and long streams of KeepStreaming clients all ended with a finish_reason."""
    for kind, stats in (("short", short), ("long", long)):
        failed = stats.failures + stats.cut
        steps.say(
            f"   {stats.requests} {kind} streams {when} ({stats.tokens} tokens), "
            f"{len(failed)} failed"
        )
        assert not failed, f"{kind} streams failed {when}: {failed}"
        assert stats.requests > 0


def outgrow_the_nodes(
    cluster: LocalCluster, autoscaler: ClusterAutoscalerStandin, steps: Steps
) -> None:
    cluster.kubectl("scale", f"pllm/{NAME}", "--replicas=3")

    def waiting() -> tuple[list[str], dict[str, Any]] | None:
        messages = [
            c["message"]
            for p in pods(cluster)
            for c in (p.get("status") or {}).get("conditions") or []
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
        ]
        body = pagedllm(cluster)
        progressing = condition(body, "Progressing")
        if (
            len(messages) == 2
            and progressing.get("reason") == "WaitingForCapacity"
            and progressing["message"].startswith("2 pods wait")
            and condition(body, "Degraded").get("status") == "False"
        ):
            return messages, progressing
        return None

    # Before the autoscaler's delay is over (then a node comes and they are scheduled).
    messages, progressing = eventually(
        waiting, timeout=NODE_TIMERS.scale_up_delay + 20, what="two pods waiting"
    )
    assert all("Insufficient nvidia.com/gpu" in m for m in messages), messages
    steps.say(f"   pods: {messages[0]}")
    steps.say(f"   Progressing/WaitingForCapacity: {progressing['message']}")
    eventually(lambda: autoscaler.stats.added, timeout=30, what="a node to be added")
    # Three ready at once: the first pod's node is drained once the budget allows (next step).
    eventually(lambda: len(serving_pods(cluster)) == 3, timeout=150, what="3 ready pods")
    steps.say(f"   added {autoscaler.stats.added}; GPU nodes: {nodes_line(cluster)}")


def drain_the_small_node(
    cluster: LocalCluster, autoscaler: ClusterAutoscalerStandin, steps: Steps
) -> None:
    """The first pod fits on the new node beside the others: the autoscaler stand-in cordons
    the 1-GPU node and evicts its pod, which the budget (one of three unavailable at most)
    refuses until the new pods are ready; the replacement starts on the new node, and the
    evicted pod drains its streams before it goes."""
    fewest_ready = [len(serving_pods(cluster))]

    def drained() -> bool:
        fewest_ready[0] = min(fewest_ready[0], len(serving_pods(cluster)))
        return bool(autoscaler.stats.drained) and ready_with(cluster, 3) is not None

    eventually(drained, timeout=150, what="a node to be drained and removed", interval=0.5)
    eventually(lambda: routers_follow_the_pods(cluster), timeout=30, what="routers' backends")
    time.sleep(1)  # and streaming on the replacement
    stats = autoscaler.stats
    steps.say(
        f"   drained {stats.drained}: evicted {stats.evicted}, {stats.refused} evictions "
        f"refused by the PDB and retried; fewest ready serving pods since all 3 were: "
        f"{fewest_ready[0]}; GPU nodes: {nodes_line(cluster)}"
    )
    assert stats.evicted and stats.refused >= 1 and fewest_ready[0] >= 2, stats


def scaled_to_zero(cluster: LocalCluster) -> dict[str, Any] | None:
    """The PagedLLM once it is at zero replicas with no serving pod left (not even a stopping
    one) and its routers ready to hold what comes."""
    body = pagedllm(cluster)
    status = body.get("status") or {}
    if (
        body["spec"].get("replicas") == 0
        and status.get("observedGeneration") == body["metadata"]["generation"]
        and not status.get("readyReplicas")
        and not pods(cluster)
        and len(ready_routers(cluster)) == ROUTERS
        and condition(body, "Ready").get("reason") == "ScaledToZero"
    ):
        return body
    return None


def held_requests(cluster: LocalCluster) -> float:
    """Requests the routers hold for a ready serving pod, all together."""
    return sum(
        pod_metric(router, "pagedllm:router_held_requests") for router in ready_routers(cluster)
    )


def held_stream_wakes_it(cluster: LocalCluster, base_url: str, steps: Steps) -> None:
    """One streaming completion sent while nothing serves: a router holds it and writes /scale,
    the pod starts, and the stream runs to its end with no error and no retry."""
    api = openai_client(base_url, None, timeout=300)
    pieces: list[str] = []
    finish: list[str | None] = []
    first_token: list[float] = []

    def stream() -> None:
        sent = time.monotonic()
        for chunk in api.completions.create(
            model=MODEL, prompt="Wake up,", max_tokens=MAX_TOKENS, temperature=0, stream=True
        ):
            for choice in chunk.choices:
                if not first_token and choice.text:
                    first_token.append(time.monotonic() - sent)
                pieces.append(choice.text)
                finish.append(choice.finish_reason)

    with ThreadPoolExecutor(1) as pool:
        sent_at = time.monotonic()
        answer = pool.submit(stream)
        eventually(lambda: held_requests(cluster) == 1, timeout=30, what="a router to hold it")
        steps.say(f"   held after {time.monotonic() - sent_at:.1f} s while 0 pods serve")
        eventually(
            lambda: pagedllm(cluster)["spec"]["replicas"] >= 1,
            timeout=30,
            what="the PagedLLM to be scaled from zero",
        )
        answer.result(timeout=240)
    text = "".join(pieces)
    assert text and finish[-1] in ("stop", "length"), (pieces, finish)
    assert first_token, "no token came"
    steps.say(
        f"   first token {first_token[0]:.1f} s after the request (a pod's whole start), "
        f"{len([p for p in pieces if p])} chunks, finish_reason {finish[-1]}"
    )
    eventually(lambda: ready_with(cluster, 1), timeout=60, what="1 replica serving")


def scaled_up_and_serving(cluster: LocalCluster) -> int | None:
    """The replicas, once the autoscaler's added ones all serve."""
    body = pagedllm(cluster)
    wanted = body["spec"]["replicas"]
    ready = (body.get("status") or {}).get("readyReplicas", 0)
    return wanted if wanted > 1 and ready == wanted == len(serving_pods(cluster)) else None


def latest_event(cluster: LocalCluster, reason: str) -> str:
    """The newest Event of ``reason``; the operator posts it just after it writes the scale
    that the step saw, so it may take a moment to appear."""

    def messages() -> list[str]:
        return cluster.kubectl(
            "get",
            "events",
            f"--field-selector=reason={reason}",
            "--sort-by=.lastTimestamp",
            "-o",
            "custom-columns=MESSAGE:.message",
            "--no-headers",
        ).splitlines()

    return f"{reason}: {eventually(messages, timeout=30, what=f'a {reason} event')[-1]}"


def routers_follow_the_pods(cluster: LocalCluster) -> bool:
    """Every router lists exactly the ready serving pods as its live backends (discovered
    through the serving Service's EndpointSlices, each feed subscribed)."""
    wanted = {local_url(p) for p in serving_pods(cluster)}
    ready = ready_routers(cluster)
    if len(ready) != ROUTERS:
        return False
    for router in ready:
        text = httpx.get(f"{local_url(router)}/metrics", timeout=5, trust_env=False).text
        live = set(re.findall(r'router_backend_ready\{backend="([^"]+)"\} 1\.0', text))
        listed = set(re.findall(r'router_backend_ready\{backend="([^"]+)"\}', text))
        if live != wanted or listed != wanted:
            return False
    return True


def every_pod_answers(cluster: LocalCluster, base_url: str) -> None:
    """Distinct prompts cached nowhere, one per fresh connection, reach every ready pod."""
    ready = serving_pods(cluster)
    before = {p["metadata"]["name"]: pod_metric(p, "vllm:request_success_total") for p in ready}
    for index in range(SPREAD_PROMPTS):
        response = httpx.post(
            f"{base_url}/completions",
            timeout=60,
            trust_env=False,
            json={"model": MODEL, "prompt": f"Hello number {index}", "max_tokens": 4},
        )
        response.raise_for_status()
    after = {p["metadata"]["name"]: pod_metric(p, "vllm:request_success_total") for p in ready}
    idle = [name for name in before if after[name] <= before[name]]
    assert not idle, f"pods that served nothing: {idle} ({before} -> {after})"


def restarts(pod: dict[str, Any]) -> int:
    return sum(
        c.get("restartCount", 0) for c in (pod.get("status") or {}).get("containerStatuses") or []
    )


def kill_a_router(cluster: LocalCluster, base_url: str, steps: Steps) -> None:
    """Clients stream through the Service (each keeps its connection, so both routers carry
    some) while one router's processes get SIGKILL. Streams that had opened through it may
    break; every other request must succeed, on the other router, with the SDK retrying
    connection errors for as long as the Service takes to drop the dead router. The kubelet
    restarts the router and it serves again."""
    victim = ready_routers(cluster)[0]
    name, restarted = victim["metadata"]["name"], restarts(victim)
    service = cluster.service_proxy(NAME)
    refused = service.refused
    # Two short and two long streams back to back.
    clients = [
        KeepStreaming(
            base_url,
            MODEL,
            max_tokens=tokens,
            ignore_eos=tokens == LONG_STREAM_TOKENS,
            retries=CRASH_RETRIES,
        )
        for tokens in (MAX_TOKENS, MAX_TOKENS, LONG_STREAM_TOKENS, LONG_STREAM_TOKENS)
    ]
    for client in clients:
        client.__enter__()
    try:
        time.sleep(2)  # streams open through both routers
        killed_at = time.monotonic()
        killed = cluster.crash_pod(name)
        dropped_at = eventually(
            lambda: len(service.endpoints) < ROUTERS and time.monotonic(),
            timeout=30,
            interval=0.02,
            what=f"the Service to drop {name}",
        )
        steps.say(
            f"   SIGKILL to {len(killed)} processes of {name}; the Service dropped it after "
            f"{dropped_at - killed_at:.2f}s, {service.refused - refused} connections refused "
            "meanwhile"
        )
        eventually(
            lambda: any(
                p["metadata"]["name"] == name and restarts(p) > restarted
                for p in ready_routers(cluster)
            ),
            timeout=90,
            what=f"{name} to restart and be ready again",
        )
        eventually(lambda: routers_follow_the_pods(cluster), timeout=30, what="routers' backends")
        time.sleep(1)  # and streaming through it again
    finally:
        stats = [client.stop() for client in clients]
    requests = sum(s.requests for s in stats)
    failed = [f for s in stats for f in s.failures]
    cut = [f for s in stats for f in s.cut]
    steps.say(f"   {requests} streams, {len(cut)} cut mid-stream by the kill, {len(failed)} failed")
    assert requests > 0
    assert not failed, f"requests that had not started streaming failed: {failed}"
    body = pagedllm(cluster)
    assert condition(body, "Router").get("status") == "True", condition(body, "Router")


def rolling_update(cluster: LocalCluster, base_url: str, steps: Steps) -> None:
    old_pods = {p["metadata"]["name"] for p in pods(cluster)}
    old_hashes = {p["metadata"]["labels"][POD_TEMPLATE_HASH] for p in pods(cluster)}
    reasons: list[str] = []

    def rolled_out() -> bool:
        body = pagedllm(cluster)
        reason = condition(body, "Progressing").get("reason", "")
        if not reasons or reasons[-1] != reason:
            reasons.append(reason)
        current = pods(cluster)
        return (
            ready_with(cluster, 3) is not None
            and reason == "Complete"
            and not old_pods & {p["metadata"]["name"] for p in current}
            and all(engine_flag(p, "--max-num-seqs") == str(ROLLOUT_MAX_NUM_SEQS) for p in current)
        )

    # Short streams back to back, and long ones that outlast a stopping pod's preStop pause,
    # so that some are still running when their pod is told to drain.
    with (
        KeepStreaming(base_url, MODEL) as short,
        KeepStreaming(base_url, MODEL, max_tokens=LONG_STREAM_TOKENS, ignore_eos=True) as long,
    ):
        time.sleep(1)  # streaming before the rollout starts
        patch_spec(cluster, {"engine": {"maxNumSeqs": ROLLOUT_MAX_NUM_SEQS}})
        eventually(rolled_out, timeout=240, what="the rollout to finish", interval=0.5)
        cluster.kubectl("rollout", "status", f"deployment/{NAME}", "--timeout=10s")
        time.sleep(1)  # and streaming on the new pods
    none_failed(steps, "during the rollout", short.stats, long.stats)
    steps.say(f"   Progressing reasons seen: {reasons}")
    assert "RollingUpdate" in reasons
    new_hashes = {p["metadata"]["labels"][POD_TEMPLATE_HASH] for p in pods(cluster)}
    assert len(new_hashes) == 1 and not new_hashes & old_hashes
    assert not old_pods & set(cluster.pod_processes()), "old pods' processes still run"
    assert not any(is_terminating(p) for p in pods(cluster))
