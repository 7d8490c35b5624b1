"""The router's children: pure builders, checked for what the routers need and for leaving
the serving pods exactly as they were."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm.cli import build_parser
from pagedllm.operator.children import (
    HTTP_PORT,
    build_children,
    build_deployment,
    build_router_deployment,
    router_selector_labels,
    selector_labels,
)
from pagedllm.operator.spec import InvalidSpec, RouterPolicy, RouterSpec, parse_spec
from pagedllm_testing.operator_harness import OWNER, SPECS


def spec_with(router: dict[str, Any] | None = None, base: str = "demo") -> Any:
    return parse_spec({**SPECS[base], **({"router": router} if router is not None else {})})


def wanted(spec: Any, replicas: int = 2) -> dict[tuple[str, str], dict[str, Any]]:
    built = build_children(OWNER, spec, replicas, service_monitors_available=False)
    return {(c["kind"], c["metadata"]["name"]): c for c in built.wanted}


def router_pod(spec: Any) -> dict[str, Any]:
    return build_router_deployment(OWNER, spec)["spec"]["template"]["spec"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_default_spec_puts_two_routers_in_front() -> None:
    children = wanted(spec_with())
    assert set(children) == {
        ("Deployment", "llama"),
        ("Service", "llama"),
        ("PodDisruptionBudget", "llama"),
        ("ServiceAccount", "llama-router"),
        ("Role", "llama-router"),
        ("RoleBinding", "llama-router"),
        ("Service", "llama-serving"),
        ("Deployment", "llama-router"),
        ("PodDisruptionBudget", "llama-router"),
    }
    routers = children[("Deployment", "llama-router")]
    assert routers["spec"]["replicas"] == 2
    # The Service clients use (status.url) selects the routers ...
    assert children[("Service", "llama")]["spec"]["selector"] == router_selector_labels("llama")
    # ... and the serving pods get a headless Service of their own, the routers' discovery target.
    serving = children[("Service", "llama-serving")]["spec"]
    assert serving["selector"] == selector_labels("llama")
    assert serving["clusterIP"] == "None"
    assert serving["ports"] == [
        {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}
    ]
    assert children[("PodDisruptionBudget", "llama-router")]["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": router_selector_labels("llama")},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    # Permissions exist before the pods that use them.
    order = [key for key in wanted(spec_with())]
    assert order.index(("RoleBinding", "llama-router")) < order.index(
        ("Deployment", "llama-router")
    )


def test_until_a_router_is_ready_the_service_selects_the_serving_pods() -> None:
    built = build_children(
        OWNER, spec_with(), 2, service_monitors_available=False, routers_in_front=False
    )
    children = {(c["kind"], c["metadata"]["name"]): c for c in built.wanted}
    assert children[("Service", "llama")]["spec"]["selector"] == selector_labels("llama")
    assert ("Deployment", "llama-router") in children  # the routers start meanwhile


def test_router_and_serving_pods_never_select_each_other() -> None:
    spec = spec_with()
    serving = build_deployment(OWNER, spec, 2)
    routers = build_router_deployment(OWNER, spec)
    serving_labels = serving["spec"]["template"]["metadata"]["labels"]
    router_labels = routers["spec"]["template"]["metadata"]["labels"]
    assert matches(serving["spec"]["selector"]["matchLabels"], serving_labels)
    assert not matches(serving["spec"]["selector"]["matchLabels"], router_labels)
    assert matches(routers["spec"]["selector"]["matchLabels"], router_labels)
    assert not matches(routers["spec"]["selector"]["matchLabels"], serving_labels)


def test_disabled_keeps_todays_children() -> None:
    enabled, disabled = spec_with(), spec_with({"enabled": False})
    children = wanted(disabled)
    assert set(children) == {
        ("Deployment", "llama"),
        ("Service", "llama"),
        ("PodDisruptionBudget", "llama"),
    }
    assert children[("Service", "llama")]["spec"]["selector"] == selector_labels("llama")
    # The serving pods are the same with or without routers in front.
    assert wanted(enabled)[("Deployment", "llama")] == children[("Deployment", "llama")]
    assert (
        wanted(enabled)[("PodDisruptionBudget", "llama")]
        == children[("PodDisruptionBudget", "llama")]
    )


def test_one_router_has_no_disruption_budget() -> None:
    spec = spec_with({"replicas": 1})
    built = build_children(OWNER, spec, 2, service_monitors_available=False)
    assert ("PodDisruptionBudget", "llama-router") not in wanted(spec)
    assert any(r.kind == "PodDisruptionBudget" and r.name == "llama-router" for r in built.unwanted)


def test_router_flags_follow_the_spec() -> None:
    spec = spec_with(
        {
            "replicas": 3,
            "policy": "least-load",
            "loadBound": 1.5,
            "maxHeldRequests": 32,
            "holdTimeoutSeconds": 120,
        }
    )
    (container,) = router_pod(spec)["containers"]
    args = container["args"]
    assert container["command"] == ["pagedllm", "router"]
    assert flag(args, "--discover-namespace") == "models"
    assert flag(args, "--discover-service") == "llama-serving"
    assert flag(args, "--policy") == "least-load"
    assert flag(args, "--load-bound") == "1.5"
    assert flag(args, "--max-held-requests") == "32"
    assert flag(args, "--hold-timeout") == "120"
    # Holding routers wake their own PagedLLM from zero.
    assert flag(args, "--scale-from-zero") == OWNER.name
    assert flag(args, "--scale-from-zero-replicas") == "1"
    assert flag(args, "--served-model-name") == "demo"
    assert flag(args, "--port") == str(HTTP_PORT)
    assert "--backends" not in args
    # Streams through a stopping router last as long as the node's own drain allows.
    assert flag(args, "--shutdown-timeout") == str(spec.drain_timeout_seconds)


@pytest.mark.parametrize(
    ("base", "model", "init"),
    [
        ("demo", "/models/demo", ["pagedllm", "demo-model", "/models/demo"]),
        (
            "hf-gpu-hpa",
            "/models/meta-llama/Llama-3.1-8B",
            [
                "pagedllm",
                "download",
                "--tokenizer-only",
                "hf://meta-llama/Llama-3.1-8B",
                "/models/meta-llama/Llama-3.1-8B",
            ],
        ),
        ("pvc", "/models/llama/8b", None),
        ("image-path", "/opt/models/tiny", None),
    ],
)
def test_routers_get_the_tokenizer_where_the_serving_pods_get_the_model(
    base: str, model: str, init: list[str] | None
) -> None:
    spec = spec_with(base=base)
    pod = router_pod(spec)
    (container,) = pod["containers"]
    assert flag(container["args"], "--model") == model
    serving = build_deployment(OWNER, spec, 1)["spec"]["template"]["spec"]
    serving_args = serving["containers"][0]["args"]
    if "--model" in serving_args:
        assert flag(serving_args, "--model") == model  # the same path as the serving pods
    if init is None:
        assert "initContainers" not in pod
    else:
        (init_container,) = pod["initContainers"]
        assert init_container["command"] + init_container["args"] == init
        assert {"name": "model", "mountPath": "/models"} in init_container["volumeMounts"]
    if base == "pvc":
        assert {
            "name": "model",
            "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
        } in pod["volumes"]
    if base != "image-path":
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in container[
            "volumeMounts"
        ]
    # Routers compute nothing: no GPU, whatever the serving pods ask for.
    assert container["resources"] == {"requests": {"cpu": "250m", "memory": "512Mi"}}
    assert "tolerations" not in pod and "nodeSelector" not in pod


def test_router_pods_are_restricted_probed_and_drain_like_nodes() -> None:
    spec = spec_with(base="pvc")
    pod = router_pod(spec)
    serving = build_deployment(OWNER, spec, 1)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (node,) = serving["containers"]
    assert container["securityContext"] == node["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"] == serving["securityContext"]
    assert pod["terminationGracePeriodSeconds"] == serving["terminationGracePeriodSeconds"]
    assert container["lifecycle"] == node["lifecycle"]
    health = {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == health
    assert container["livenessProbe"]["httpGet"] == health
    # Its own account, the only pod of the PagedLLM with API credentials.
    assert pod["serviceAccountName"] == "llama-router"
    assert pod["automountServiceAccountToken"] is True
    # The API key the serving pods check is the one the routers check and send on.
    env = {e["name"]: e for e in container["env"]}
    assert env["PAGEDLLM_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "key", "key": "api-key"}
    }
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {
        env["HOME"]["value"],
        env["PAGEDLLM_CACHE_DIR"]["value"],
        "/tmp",
    }


def test_router_resources_can_be_set() -> None:
    spec = spec_with({"resources": {"limits": {"cpu": "2", "memory": "1Gi"}}})
    (container,) = router_pod(spec)["containers"]
    assert container["resources"] == {"limits": {"cpu": "2", "memory": "1Gi"}}


def test_scale_from_zero_asks_for_the_minimum_and_needs_holding() -> None:
    scaled = parse_spec(
        {**SPECS["demo"], "autoscaling": {"minReplicas": 3, "maxReplicas": 5, "target": 4}}
    )
    (container,) = router_pod(scaled)["containers"]
    assert flag(container["args"], "--scale-from-zero-replicas") == "3"
    (container,) = router_pod(spec_with({"maxHeldRequests": 0}))["containers"]
    assert "--scale-from-zero" not in container["args"]
    assert flag(container["args"], "--max-held-requests") == "0"


def test_router_spec_defaults_and_errors() -> None:
    assert spec_with().router == RouterSpec(
        enabled=True,
        replicas=2,
        policy=RouterPolicy.PREFIX,
        load_bound=1.25,
        max_held_requests=64,
        hold_timeout_seconds=600,
    )
    assert spec_with({"loadBound": 2}).router.load_bound == 2.0
    for router, message in [
        ({"policy": "random"}, r"spec\.router\.policy: 'random' is not one of prefix, least-load"),
        ({"replicas": 0}, r"spec\.router\.replicas must be at least 1 .*enabled: false"),
        ({"loadBound": 0.9}, r"spec\.router\.loadBound must be at least 1\.0"),
        ({"maxHeldRequests": -1}, r"spec\.router\.maxHeldRequests must not be negative"),
        ({"holdTimeoutSeconds": 0}, r"spec\.router\.holdTimeoutSeconds must be at least 1"),
        ({"enabled": "yes"}, r"spec\.router\.enabled: 'yes' has the wrong type"),
        ({"replicas": 1.5}, r"spec\.router\.replicas: 1\.5 has the wrong type"),
        ({"resources": "big"}, r"spec\.router\.resources must be an object"),
    ]:
        with pytest.raises(InvalidSpec, match=message):
            spec_with(router)
    with pytest.raises(InvalidSpec, match=r"spec\.router must be an object"):
        parse_spec({**SPECS["demo"], "router": "on"})


@pytest.mark.parametrize("policy", [p.value for p in RouterPolicy])
def test_the_router_accepts_the_flags_the_operator_writes(policy: str) -> None:
    """The router pod's command line parses with `pagedllm router`'s own parser."""
    spec = spec_with({"policy": policy, "loadBound": 1.5, "maxHeldRequests": 8}, base="pvc")
    (container,) = router_pod(spec)["containers"]
    assert container["command"] == ["pagedllm", "router"]
    parsed = build_parser().parse_args(["router", *container["args"]])
    assert parsed.policy == policy
    assert parsed.load_bound == 1.5 and parsed.max_held_requests == 8
    assert parsed.hold_timeout == 600 and parsed.scale_from_zero == "llama"
    assert (parsed.discover_namespace, parsed.discover_service) == ("models", "llama-serving")
    assert parsed.backends is None
    assert parsed.shutdown_timeout == spec.drain_timeout_seconds
