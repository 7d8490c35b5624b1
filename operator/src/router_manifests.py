"""The routers' children: their Deployment (`pagedllm router` pods with the model's tokenizer
but not its weights), the serving pods' headless Service they discover backends from, and
their ServiceAccount, Role and RoleBinding."""

from __future__ import annotations

from typing import Any

from pagedllm.operator import manifest_parts as parts
from pagedllm.operator.manifest_parts import ChildRef, Owner
from pagedllm.operator.spec import GROUP, PLURAL, ModelSourceKind, PagedLLMSpec

DEFAULT_ROUTER_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}}
# Routers read which serving pods are ready, from their Service's EndpointSlices.
ROUTER_RBAC_RULES = (
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    },
)


def router_rbac_rules(owner_name: str) -> list[dict[str, Any]]:
    """The discovery rule, and scale from zero: read and write the `/scale` of their own
    PagedLLM only (not the PagedLLM itself, whose spec they have no business changing)."""
    return [
        *(dict(rule) for rule in ROUTER_RBAC_RULES),
        {
            "apiGroups": [GROUP],
            "resources": [f"{PLURAL}/scale"],
            "resourceNames": [owner_name],
            "verbs": ["get", "patch"],
        },
    ]


def wake_replicas(spec: PagedLLMSpec) -> int:
    """What routers ask for when they find the PagedLLM at zero: max(minReplicas, 1)."""
    minimum = spec.autoscaling.min_replicas if spec.autoscaling is not None else 1
    return max(minimum, 1)


def build_serving_service(owner: Owner) -> dict[str, Any]:
    """The serving pods' own Service, headless: the routers read its EndpointSlices and
    connect to each pod directly, never through a cluster IP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": parts.object_metadata(owner, parts.serving_service_name(owner.name)),
        "spec": {
            "clusterIP": "None",
            "selector": parts.selector_labels(owner.name),
            "ports": [
                {"name": "http", "port": parts.HTTP_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def router_args(owner: Owner, spec: PagedLLMSpec, model_path: str) -> list[str]:
    router = spec.router
    return [
        "--model",
        model_path,
        "--served-model-name",
        spec.model.served_name,
        "--host",
        "0.0.0.0",
        "--port",
        str(parts.HTTP_PORT),
        "--discover-namespace",
        owner.namespace,
        "--discover-service",
        parts.serving_service_name(owner.name),
        "--policy",
        router.policy.value,
        "--load-bound",
        str(router.load_bound),
        "--max-held-requests",
        str(router.max_held_requests),
        "--hold-timeout",
        str(router.hold_timeout_seconds),
        *(
            [
                "--scale-from-zero",
                owner.name,
                "--scale-from-zero-replicas",
                str(wake_replicas(spec)),
            ]
            if router.max_held_requests > 0
            else []
        ),
        # Streams through a stopping router may last as long as the node's own drain.
        "--shutdown-timeout",
        str(spec.drain_timeout_seconds),
    ]


def build_router_pod_template(owner: Owner, spec: PagedLLMSpec) -> dict[str, Any]:
    """`pagedllm router` pods: the model's tokenizer and chat template without its weights
    (the demo model written by an init container, an hf:// model's tokenizer files only, an
    image path or a claim as the serving pods see it), credentials to watch EndpointSlices,
    and the same restricted security and SIGTERM drain as the serving pods."""
    source = spec.model.source
    model_volumes, model_mounts, model_path = parts.model_volume(spec)
    volumes = [*parts.writable_volumes(), *model_volumes]
    mounts = [*parts.writable_mounts(), *model_mounts]
    init_containers: list[dict[str, Any]] = []
    if source.kind is ModelSourceKind.DEMO:
        demo_mounts = [{"name": "model", "mountPath": parts.MODEL_DIR}, *parts.writable_mounts()]
        init_containers.append(
            parts.container(
                spec,
                "demo-model",
                "demo-model",
                [model_path],
                parts.writable_dirs_env(),
                demo_mounts,
            )
        )
    elif source.kind is ModelSourceKind.HUGGING_FACE:
        init_containers.append(parts.download_container(spec, parts.MODEL_DIR, tokenizer_only=True))

    health = parts.health_check()
    lifecycle, grace_seconds = parts.termination(spec)
    router = parts.container(
        spec,
        parts.ROUTER_COMPONENT,
        "router",
        router_args(owner, spec, model_path),
        [*parts.writable_dirs_env(), *parts.api_key_env(spec)],
        mounts,
        serves_http=True,
        resources=dict(spec.router.resources or DEFAULT_ROUTER_RESOURCES),
        # /health never depends on the serving pods; it answers 503 only while draining.
        readinessProbe=parts.readiness_probe(health),
        livenessProbe={"httpGet": health, "periodSeconds": 10, "failureThreshold": 3},
        lifecycle=lifecycle,
    )
    pod = parts.pod_spec(
        router,
        volumes,
        init_containers,
        serviceAccountName=parts.router_name(owner.name),
        # The one pod that talks to the API server: it watches its serving pods' endpoints.
        automountServiceAccountToken=True,
        terminationGracePeriodSeconds=grace_seconds,
    )
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    return parts.pod_template(parts.router_labels(owner.name), pod)


def build_router_deployment(owner: Owner, spec: PagedLLMSpec) -> dict[str, Any]:
    return parts.deployment(
        parts.object_metadata(
            owner, parts.router_name(owner.name), parts.router_labels(owner.name)
        ),
        spec.router.replicas,
        parts.router_selector_labels(owner.name),
        # Routers start in seconds: a new one is ready before an old one stops.
        {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        build_router_pod_template(owner, spec),
    )


def build_router_rbac(owner: Owner) -> list[dict[str, Any]]:
    """The routers' ServiceAccount, allowed to read EndpointSlices of this namespace only."""
    name = parts.router_name(owner.name)
    labels = parts.router_labels(owner.name)
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": parts.object_metadata(owner, name, labels),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": parts.object_metadata(owner, name, labels),
            "rules": router_rbac_rules(owner.name),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": parts.object_metadata(owner, name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def router_children_refs(owner_name: str) -> tuple[ChildRef, ...]:
    """Every child the router adds (what goes when spec.router.enabled turns false)."""
    name = parts.router_name(owner_name)
    return (
        ChildRef("apps/v1", "Deployment", name),
        ChildRef("policy/v1", "PodDisruptionBudget", name),
        ChildRef("v1", "Service", parts.serving_service_name(owner_name)),
        ChildRef("rbac.authorization.k8s.io/v1", "RoleBinding", name),
        ChildRef("rbac.authorization.k8s.io/v1", "Role", name),
        ChildRef("v1", "ServiceAccount", name),
    )
