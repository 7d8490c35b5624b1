"""The objects a PagedLLM owns, built by pure functions: spec in, manifests out.

``build_children`` lists them; the node's are built in ``node_manifests``, the routers' in
``router_manifests``, and what both share (names, labels, the container and pod pieces) in
``manifest_parts``. Their names stay importable from here, as before the split.
"""

from __future__ import annotations

from pagedllm.operator.manifest_parts import (
    CACHE_DIR,
    DEMO_MODEL_SUBDIR,
    HOME_DIR,
    HTTP_PORT,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    METRICS_PORT_ANNOTATION,
    MODEL_DIR,
    OPERATOR_NAME,
    PRE_STOP_SECONDS,
    ROUTER_APP_NAME,
    ROUTER_COMPONENT,
    RUN_AS_USER,
    ChildRef,
    Children,
    Owner,
    build_disruption_budget,
    build_service,
    child_labels,
    router_labels,
    router_name,
    router_selector_labels,
    router_selector_string,
    selector_labels,
    selector_string,
    selects_routers,
    service_url,
    serving_service_name,
)
from pagedllm.operator.node_manifests import (
    ADAPTER_CLAIMS_DIR,
    ADAPTERS_DIR,
    ADAPTERS_KEY,
    CONTAINER_NAME,
    CPUS_ENV,
    GPU_TAINT,
    STARTUP_PROBE_PERIOD_SECONDS,
    STARTUP_TIMEOUT_SECONDS,
    adapter_location,
    adapters_config_map_name,
    adapters_file,
    build_adapters_config_map,
    build_deployment,
    build_horizontal_autoscaler,
    build_pod_template,
    build_service_monitor,
    lora_args,
    serve_args,
)
from pagedllm.operator.router_manifests import (
    DEFAULT_ROUTER_RESOURCES,
    ROUTER_RBAC_RULES,
    build_router_deployment,
    build_router_pod_template,
    build_router_rbac,
    build_serving_service,
    router_args,
    router_children_refs,
    router_rbac_rules,
    wake_replicas,
)
from pagedllm.operator.spec import AutoscalingMode, PagedLLMSpec

# Everything the children modules built before the split, importable from here as then.
__all__ = [
    "ADAPTERS_DIR",
    "ADAPTERS_KEY",
    "ADAPTER_CLAIMS_DIR",
    "CACHE_DIR",
    "CONTAINER_NAME",
    "CPUS_ENV",
    "ChildRef",
    "Children",
    "DEFAULT_ROUTER_RESOURCES",
    "DEMO_MODEL_SUBDIR",
    "GPU_TAINT",
    "HOME_DIR",
    "HTTP_PORT",
    "LABEL_COMPONENT",
    "LABEL_INSTANCE",
    "LABEL_MANAGED_BY",
    "LABEL_NAME",
    "METRICS_PORT_ANNOTATION",
    "MODEL_DIR",
    "OPERATOR_NAME",
    "Owner",
    "PRE_STOP_SECONDS",
    "ROUTER_APP_NAME",
    "ROUTER_COMPONENT",
    "ROUTER_RBAC_RULES",
    "RUN_AS_USER",
    "STARTUP_PROBE_PERIOD_SECONDS",
    "STARTUP_TIMEOUT_SECONDS",
    "adapter_location",
    "adapters_config_map_name",
    "adapters_file",
    "build_adapters_config_map",
    "build_children",
    "build_deployment",
    "build_disruption_budget",
    "build_horizontal_autoscaler",
    "build_pod_template",
    "build_router_deployment",
    "build_router_pod_template",
    "build_router_rbac",
    "build_service",
    "build_service_monitor",
    "build_serving_service",
    "child_labels",
    "lora_args",
    "router_args",
    "router_children_refs",
    "router_labels",
    "router_name",
    "router_rbac_rules",
    "router_selector_labels",
    "router_selector_string",
    "selector_labels",
    "selector_string",
    "selects_routers",
    "serve_args",
    "service_url",
    "serving_service_name",
    "wake_replicas",
]


def build_children(
    owner: Owner,
    spec: PagedLLMSpec,
    replicas: int,
    service_monitors_available: bool,
    routers_in_front: bool = True,
) -> Children:
    """`routers_in_front`: whether the Service may select the routers yet (with
    spec.router.enabled); see reconcile."""
    wanted = []
    unwanted = []
    adapters = ChildRef("v1", "ConfigMap", adapters_config_map_name(owner.name))
    if spec.lora_enabled:
        # Before the Deployment: its pods mount it.
        wanted.append(build_adapters_config_map(owner, spec))
    else:
        unwanted.append(adapters)
    wanted += [
        build_deployment(owner, spec, replicas),
        build_service(owner, spec, routers_in_front),
    ]
    pdb = ChildRef("policy/v1", "PodDisruptionBudget", owner.name)
    if replicas > 1:
        wanted.append(build_disruption_budget(owner))
    else:
        unwanted.append(pdb)
    hpa = ChildRef("autoscaling/v2", "HorizontalPodAutoscaler", owner.name)
    if spec.autoscaling is not None and spec.autoscaling.mode is AutoscalingMode.HPA:
        wanted.append(build_horizontal_autoscaler(owner, spec))
    else:
        unwanted.append(hpa)
    if service_monitors_available:
        wanted.append(build_service_monitor(owner))
    if spec.router.enabled:
        # Permissions and the discovery target before the routers that need them.
        wanted += [*build_router_rbac(owner), build_serving_service(owner)]
        wanted.append(build_router_deployment(owner, spec))
        router_pdb = ChildRef("policy/v1", "PodDisruptionBudget", router_name(owner.name))
        if spec.router.replicas > 1:
            wanted.append(build_disruption_budget(owner, router=True))
        else:
            unwanted.append(router_pdb)
    else:
        unwanted += router_children_refs(owner.name)
    return Children(wanted=tuple(wanted), unwanted=tuple(unwanted))
