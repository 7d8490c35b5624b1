"""The objects a PagedLLM owns, built by pure functions: spec in, manifests out.

Names are deterministic (the PagedLLM's own name), so applying them again finds the same
objects: nothing is ever duplicated, whatever restarts in between.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.operator.spec import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    AdapterSpec,
    AutoscalingMode,
    ModelSourceKind,
    PagedLLMSpec,
    format_quantity,
)

OPERATOR_NAME = "pagedllm-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "pagedllm.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
CPUS_ENV = "PAGEDLLM_CPUS"
# Tests and the e2e kubelet stand-in run pods as local processes on loopback ports; this pod
# annotation tells the autoscaler which port serves /metrics instead of the container port.
METRICS_PORT_ANNOTATION = "pagedllm.io/metrics-port"

CONTAINER_NAME = "pagedllm"
HTTP_PORT = 8000
MODEL_DIR = "/models"
CACHE_DIR = "/var/cache/pagedllm"
HOME_DIR = "/home/pagedllm"
# The adapters' ConfigMap, mounted whole (not by subPath, which the kubelet never refreshes):
# the node watches the file, so a changed list reaches running pods without a restart.
ADAPTERS_DIR = "/etc/pagedllm/adapters"
ADAPTERS_KEY = "adapters.json"
# Where adapter claims other than the model's are mounted, each under its own name.
ADAPTER_CLAIMS_DIR = "/adapters"
RUN_AS_USER = 1000
# Time for endpoints to drop a stopping pod before it is told to drain.
PRE_STOP_SECONDS = 5
# Slow model loads (a large hf:// download, a cold PVC) must not get the pod killed.
STARTUP_PROBE_PERIOD_SECONDS = 5
STARTUP_TIMEOUT_SECONDS = 30 * 60
GPU_TAINT = "nvidia.com/gpu"

ROUTER_COMPONENT = "router"
ROUTER_APP_NAME = "pagedllm-router"
# Where routers find the demo model's tokenizer (written by an init container).
DEMO_MODEL_SUBDIR = "demo"
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


@dataclass(frozen=True)
class Owner:
    """The PagedLLM that children belong to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        metadata = body["metadata"]
        return cls(name=metadata["name"], namespace=metadata["namespace"], uid=metadata["uid"])


@dataclass(frozen=True)
class ChildRef:
    api_version: str
    kind: str
    name: str


@dataclass(frozen=True)
class Children:
    wanted: tuple[dict[str, Any], ...]
    # Children this spec no longer wants (e.g. the PDB after scaling to one replica).
    unwanted: tuple[ChildRef, ...]


def selector_labels(owner_name: str) -> dict[str, str]:
    return {LABEL_NAME: "pagedllm", LABEL_INSTANCE: owner_name}


def selector_string(owner_name: str) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(owner_name).items()))


def child_labels(owner_name: str) -> dict[str, str]:
    return {
        **selector_labels(owner_name),
        LABEL_MANAGED_BY: OPERATOR_NAME,
        LABEL_COMPONENT: "server",
    }


def router_name(owner_name: str) -> str:
    """The router Deployment, its PDB and its ServiceAccount, Role and RoleBinding."""
    return f"{owner_name}-router"


def serving_service_name(owner_name: str) -> str:
    """The serving pods' own Service: what the routers discover their backends from."""
    return f"{owner_name}-serving"


def router_selector_labels(owner_name: str) -> dict[str, str]:
    # A name of its own: the serving Deployment's (immutable) selector must not match routers.
    return {LABEL_NAME: ROUTER_APP_NAME, LABEL_INSTANCE: owner_name}


def selects_routers(service: Mapping[str, Any] | None, owner_name: str) -> bool:
    """Whether this Service (the PagedLLM's own) already sends clients to the routers."""
    selector = ((service or {}).get("spec") or {}).get("selector")
    return selector == router_selector_labels(owner_name)


def router_selector_string(owner_name: str) -> str:
    labels = router_selector_labels(owner_name)
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def router_labels(owner_name: str) -> dict[str, str]:
    return {
        **router_selector_labels(owner_name),
        LABEL_MANAGED_BY: OPERATOR_NAME,
        LABEL_COMPONENT: ROUTER_COMPONENT,
    }


def service_url(owner: Owner, spec: PagedLLMSpec) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.service.port}"


def _metadata(
    owner: Owner, name: str | None = None, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "name": name or owner.name,
        "namespace": owner.namespace,
        "labels": labels or child_labels(owner.name),
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def serve_args(spec: PagedLLMSpec, model_path: str | None) -> list[str]:
    engine = spec.engine
    args = []
    if model_path is not None:
        args += ["--model", model_path]
    args += [
        "--host",
        "0.0.0.0",
        "--port",
        str(HTTP_PORT),
        "--served-model-name",
        spec.model.served_name,
        "--block-size",
        str(engine.block_size),
        "--gpu-memory-utilization",
        str(engine.gpu_memory_utilization),
        "--max-num-seqs",
        str(engine.max_num_seqs),
        "--max-num-batched-tokens",
        str(engine.max_num_batched_tokens),
        "--dtype",
        engine.dtype,
        "--tensor-parallel-size",
        str(engine.tensor_parallel_size),
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
        "--shutdown-timeout",
        str(spec.drain_timeout_seconds),
    ]
    if engine.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory", str(engine.kv_cache_memory_bytes)]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.quantization is not None:
        args += ["--quantization", engine.quantization]
    if engine.kv_cache_dtype != "auto":  # absent, the pod templates of earlier releases stay
        args += ["--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.speculative is not None:
        args += ["--speculative-config", engine.speculative.to_json()]
    if spec.observability.otlp_endpoint is not None:
        args += ["--otlp-traces-endpoint", spec.observability.otlp_endpoint]
    return args + lora_args(spec) + list(engine.extra_args)


def lora_args(spec: PagedLLMSpec) -> list[str]:
    """The node's LoRA flags. The adapters themselves are not among them: they come from the
    mounted file, so that changing them changes no pod template."""
    if not spec.lora_enabled:
        return []
    lora = spec.lora_settings
    args = [
        "--enable-lora",
        "--max-loras",
        str(lora.max_loras),
        "--max-lora-rank",
        str(lora.max_lora_rank),
    ]
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    return args + ["--lora-modules-file", f"{ADAPTERS_DIR}/{ADAPTERS_KEY}"]


def adapters_config_map_name(owner_name: str) -> str:
    return f"{owner_name}-adapters"


def _adapter_claims(spec: PagedLLMSpec) -> list[str]:
    """The claims adapters live on that the pods do not mount for the model, in first-use
    order."""
    model = spec.model.source
    model_claim = model.claim if model.kind is ModelSourceKind.PVC else None
    claims: list[str] = []
    for adapter in spec.adapters:
        claim = adapter.source.claim
        if adapter.source.kind is ModelSourceKind.PVC and claim != model_claim:
            if claim not in claims:
                claims.append(claim)
    return claims


def _claim_volume_name(claim: str) -> str:
    # Claim names may be 253 characters, volume names 63: a digest keeps them apart.
    return f"adapters-{hashlib.sha256(claim.encode()).hexdigest()[:12]}"


def adapter_location(spec: PagedLLMSpec, adapter: AdapterSpec) -> str:
    """Where the node finds the adapter: a path in the container, or an hf:// URI that it
    downloads itself (an init container cannot run for a pod that already serves)."""
    source = adapter.source
    if source.kind is ModelSourceKind.HUGGING_FACE:
        return source.hub_uri
    if source.kind is ModelSourceKind.PVC:
        model = spec.model.source
        if model.kind is ModelSourceKind.PVC and model.claim == source.claim:
            return f"{MODEL_DIR}/{source.path}"
        return f"{ADAPTER_CLAIMS_DIR}/{source.claim}/{source.path}"
    return source.path


def adapters_file(spec: PagedLLMSpec) -> str:
    """The content of the node's --lora-modules-file: the adapters in spec order."""
    entries = [
        {"name": a.name, "uri": adapter_location(spec, a), "preload": a.preload}
        for a in spec.adapters
    ]
    return json.dumps(entries, indent=2) + "\n"


def build_adapters_config_map(owner: Owner, spec: PagedLLMSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, adapters_config_map_name(owner.name)),
        "data": {ADAPTERS_KEY: adapters_file(spec)},
    }


def _adapter_volumes(
    owner: Owner, spec: PagedLLMSpec
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The adapters' ConfigMap and the adapter claims, with their read-only mounts."""
    if not spec.lora_enabled:
        return [], []
    volumes: list[dict[str, Any]] = [
        {"name": "adapters", "configMap": {"name": adapters_config_map_name(owner.name)}}
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "adapters", "mountPath": ADAPTERS_DIR, "readOnly": True}
    ]
    for claim in _adapter_claims(spec):
        name = _claim_volume_name(claim)
        volumes.append(
            {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        mounts.append(
            {"name": name, "mountPath": f"{ADAPTER_CLAIMS_DIR}/{claim}", "readOnly": True}
        )
    return volumes, mounts


def _container_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _writable_dirs_env() -> list[dict[str, Any]]:
    # The root filesystem is read-only: the demo model, Hub downloads and anything written
    # under $HOME go to emptyDirs.
    return [
        {"name": "PAGEDLLM_CACHE_DIR", "value": CACHE_DIR},
        {"name": "HOME", "value": HOME_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
    ]


def _writable_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "home", "mountPath": HOME_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]


def _download_container(
    spec: PagedLLMSpec, mount_path: str, *, tokenizer_only: bool = False
) -> dict[str, Any]:
    """The init container that fetches an hf:// model (or one GGUF file of it) into the
    "model" volume."""
    return {
        "name": "download",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["pagedllm", "download"],
        "args": [
            *(["--tokenizer-only"] if tokenizer_only else []),
            spec.model.source.hub_uri,
            _hub_download_dir(spec),
        ],
        "env": [*_writable_dirs_env(), *[dict(e) for e in spec.env]],
        "volumeMounts": [{"name": "model", "mountPath": mount_path}, *_writable_mounts()],
        "securityContext": _container_security_context(),
    }


def _hub_download_dir(spec: PagedLLMSpec) -> str:
    return f"{MODEL_DIR}/{spec.model.source.path}"


def _model_volume(spec: PagedLLMSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """The model's volumes and read-only mounts, and its directory in the container: an
    image path as it is, a claim mounted, or an emptyDir that an init container fills (an
    hf:// download, or the demo model written for routers)."""
    source = spec.model.source
    if source.kind is ModelSourceKind.IMAGE:
        return [], [], source.path
    mount = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
    path = f"{MODEL_DIR}/{source.path or DEMO_MODEL_SUBDIR}"
    if source.kind is ModelSourceKind.HUGGING_FACE and source.file:
        path = f"{_hub_download_dir(spec)}/{source.file}"  # the node serves the GGUF file
    if source.kind is ModelSourceKind.PVC:
        claim = {"claimName": source.claim, "readOnly": True}
        return [{"name": "model", "persistentVolumeClaim": claim}], [mount], path
    return [{"name": "model", "emptyDir": {}}], [mount], path


def _api_key_env(spec: PagedLLMSpec) -> list[dict[str, Any]]:
    if spec.api_key_secret is None:
        return []
    return [
        {
            "name": "PAGEDLLM_API_KEY",
            "valueFrom": {
                "secretKeyRef": {"name": spec.api_key_secret.name, "key": spec.api_key_secret.key}
            },
        }
    ]


def _pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _termination(spec: PagedLLMSpec) -> tuple[dict[str, Any], int]:
    """The preStop pause (time for endpoints to drop the pod) and the grace period that
    covers it and the drain that SIGTERM starts."""
    lifecycle = {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}}
    return lifecycle, PRE_STOP_SECONDS + spec.drain_timeout_seconds + 5


def _scrape_annotations() -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(HTTP_PORT),
        "prometheus.io/path": "/metrics",
    }


def _tolerations(spec: PagedLLMSpec) -> list[dict[str, Any]]:
    tolerations = [dict(t) for t in spec.scheduling.tolerations]
    # GPU node pools are commonly tainted; a pod asking for GPUs is meant to land there.
    if spec.requests_gpus and not any(t.get("key") == GPU_TAINT for t in tolerations):
        tolerations.append({"key": GPU_TAINT, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def build_pod_template(owner: Owner, spec: PagedLLMSpec) -> dict[str, Any]:
    source = spec.model.source
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "cache", "emptyDir": {}},
        {"name": "home", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, *_writable_mounts()]
    init_containers: list[dict[str, Any]] = []
    model_path: str | None = None  # the node's built-in demo model
    if source.kind is not ModelSourceKind.DEMO:
        model_volumes, model_mounts, model_path = _model_volume(spec)
        volumes += model_volumes
        mounts += model_mounts
        if source.kind is ModelSourceKind.HUGGING_FACE:
            init_containers.append(_download_container(spec, MODEL_DIR))
    adapter_volumes, adapter_mounts = _adapter_volumes(owner, spec)
    volumes += adapter_volumes
    mounts += adapter_mounts

    env = _writable_dirs_env()
    # The worker's compute threads: the CPUs the pod requests (rounded up), not every core of
    # the node, which pods beside it share.
    env.append(
        {
            "name": CPUS_ENV,
            "valueFrom": {
                "resourceFieldRef": {
                    "containerName": CONTAINER_NAME,
                    "resource": "requests.cpu",
                    "divisor": "1",
                }
            },
        }
    )
    env += _api_key_env(spec)
    env += [dict(e) for e in spec.env]

    health = {"path": "/health", "port": "http"}
    lifecycle, grace_seconds = _termination(spec)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["pagedllm", "serve"],
        "args": serve_args(spec, model_path),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": env,
        "volumeMounts": mounts,
        "securityContext": _container_security_context(),
        # /health answers 503 while draining, which takes the pod out of the Service.
        "readinessProbe": {"httpGet": health, "periodSeconds": 5, "failureThreshold": 2},
        "startupProbe": {
            "httpGet": health,
            "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS,
            "failureThreshold": STARTUP_TIMEOUT_SECONDS // STARTUP_PROBE_PERIOD_SECONDS,
        },
        "lifecycle": lifecycle,
    }
    if spec.resources:
        container["resources"] = dict(spec.resources)

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": _pod_security_context(),
        # SIGTERM makes the node drain for drainTimeoutSeconds after the preStop pause.
        "terminationGracePeriodSeconds": grace_seconds,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    tolerations = _tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(spec.scheduling.node_selector)
    if spec.scheduling.affinity:
        pod_spec["affinity"] = spec.scheduling.affinity
    if spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name

    return {
        "metadata": {
            "labels": child_labels(owner.name),
            "annotations": _scrape_annotations(),
        },
        "spec": pod_spec,
    }


def build_deployment(owner: Owner, spec: PagedLLMSpec, replicas: int) -> dict[str, Any]:
    if spec.rollout.strategy == "Recreate":
        strategy: dict[str, Any] = {"type": "Recreate"}
    else:
        strategy = {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable,
            },
        }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": strategy,
            # Model loads are slow: a rollout is "stuck" only after the startup allowance.
            "progressDeadlineSeconds": STARTUP_TIMEOUT_SECONDS + 600,
            "revisionHistoryLimit": 3,
            "template": build_pod_template(owner, spec),
        },
    }


def build_service(
    owner: Owner, spec: PagedLLMSpec, routers_in_front: bool = True
) -> dict[str, Any]:
    """The Service clients use (status.url): the routers, or without them (or until one of
    them is ready, see `routers_in_front`) the serving pods."""
    in_front = spec.router.enabled and routers_in_front
    selector = router_selector_labels(owner.name) if in_front else selector_labels(owner.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {
            "type": spec.service.type,
            "selector": selector,
            "ports": [
                {"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_serving_service(owner: Owner) -> dict[str, Any]:
    """The serving pods' own Service, headless: the routers read its EndpointSlices and
    connect to each pod directly, never through a cluster IP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, serving_service_name(owner.name)),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(owner.name),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_disruption_budget(owner: Owner, *, router: bool = False) -> dict[str, Any]:
    selector = router_selector_labels(owner.name) if router else selector_labels(owner.name)
    metadata = (
        _metadata(owner, router_name(owner.name), router_labels(owner.name))
        if router
        else _metadata(owner)
    )
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {
            # One pod at a time may be evicted (node drains, cluster-autoscaler scale-downs).
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector},
            # A pod that never got ready must not block draining its node.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
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
        str(HTTP_PORT),
        "--discover-namespace",
        owner.namespace,
        "--discover-service",
        serving_service_name(owner.name),
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
    volumes: list[dict[str, Any]] = [
        {"name": "cache", "emptyDir": {}},
        {"name": "home", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    model_volumes, model_mounts, model_path = _model_volume(spec)
    volumes += model_volumes
    mounts = [*_writable_mounts(), *model_mounts]
    init_containers: list[dict[str, Any]] = []
    if source.kind is ModelSourceKind.DEMO:
        init_containers.append(
            {
                "name": "demo-model",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": ["pagedllm", "demo-model"],
                "args": [model_path],
                "env": _writable_dirs_env(),
                "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR}, *_writable_mounts()],
                "securityContext": _container_security_context(),
            }
        )
    elif source.kind is ModelSourceKind.HUGGING_FACE:
        init_containers.append(_download_container(spec, MODEL_DIR, tokenizer_only=True))

    health = {"path": "/health", "port": "http"}
    lifecycle, grace_seconds = _termination(spec)
    container: dict[str, Any] = {
        "name": ROUTER_COMPONENT,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["pagedllm", "router"],
        "args": router_args(owner, spec, model_path),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": [*_writable_dirs_env(), *_api_key_env(spec)],
        "volumeMounts": mounts,
        "securityContext": _container_security_context(),
        "resources": dict(spec.router.resources or DEFAULT_ROUTER_RESOURCES),
        # /health never depends on the serving pods; it answers 503 only while draining.
        "readinessProbe": {"httpGet": health, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": health, "periodSeconds": 10, "failureThreshold": 3},
        "lifecycle": lifecycle,
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": _pod_security_context(),
        "serviceAccountName": router_name(owner.name),
        # The one pod that talks to the API server: it watches its serving pods' endpoints.
        "automountServiceAccountToken": True,
        "terminationGracePeriodSeconds": grace_seconds,
        "enableServiceLinks": False,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name
    return {
        "metadata": {"labels": router_labels(owner.name), "annotations": _scrape_annotations()},
        "spec": pod_spec,
    }


def build_router_deployment(owner: Owner, spec: PagedLLMSpec) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, router_name(owner.name), router_labels(owner.name)),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": router_selector_labels(owner.name)},
            # Routers start in seconds: a new one is ready before an old one stops.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 3,
            "template": build_router_pod_template(owner, spec),
        },
    }


def build_router_rbac(owner: Owner) -> list[dict[str, Any]]:
    """The routers' ServiceAccount, allowed to read EndpointSlices of this namespace only."""
    name = router_name(owner.name)
    labels = router_labels(owner.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner, name, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(owner, name, labels),
            "rules": router_rbac_rules(owner.name),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(owner, name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def router_children_refs(owner_name: str) -> tuple[ChildRef, ...]:
    """Every child the router adds (what goes when spec.router.enabled turns false)."""
    name = router_name(owner_name)
    return (
        ChildRef("apps/v1", "Deployment", name),
        ChildRef("policy/v1", "PodDisruptionBudget", name),
        ChildRef("v1", "Service", serving_service_name(owner_name)),
        ChildRef("rbac.authorization.k8s.io/v1", "RoleBinding", name),
        ChildRef("rbac.authorization.k8s.io/v1", "Role", name),
        ChildRef("v1", "ServiceAccount", name),
    )


def build_horizontal_autoscaler(owner: Owner, spec: PagedLLMSpec) -> dict[str, Any]:
    scaling = spec.autoscaling
    assert scaling is not None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(owner),
        "spec": {
            # The HPA scales the PagedLLM through its /scale, never the Deployment directly.
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name},
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": scaling.metric.custom_metric_name},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": format_quantity(scaling.target),
                        },
                    },
                }
            ],
            "behavior": {
                "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_delay_seconds},
                "scaleUp": {"stabilizationWindowSeconds": 0},
            },
        },
    }


def build_service_monitor(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(owner),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }


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
