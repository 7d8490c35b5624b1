"""The serving pods' children: their Deployment (the node's pod: `pagedllm serve` and its
flags, the model's and the adapters' volumes), the adapters' ConfigMap, the
HorizontalPodAutoscaler and the ServiceMonitor."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pagedllm.operator.manifest_parts import (
    HTTP_PORT,
    MODEL_DIR,
    Owner,
    api_key_env,
    child_labels,
    container,
    deployment,
    download_container,
    health_check,
    model_volume,
    object_metadata,
    pod_spec,
    pod_template,
    readiness_probe,
    selector_labels,
    termination,
    writable_dirs_env,
    writable_mounts,
    writable_volumes,
)
from pagedllm.operator.spec import (
    API_VERSION,
    KIND,
    AdapterSpec,
    ModelSourceKind,
    PagedLLMSpec,
    format_quantity,
)

CPUS_ENV = "PAGEDLLM_CPUS"
CONTAINER_NAME = "pagedllm"
# The adapters' ConfigMap, mounted whole (not by subPath, which the kubelet never refreshes):
# the node watches the file, so a changed list reaches running pods without a restart.
ADAPTERS_DIR = "/etc/pagedllm/adapters"
ADAPTERS_KEY = "adapters.json"
# Where adapter claims other than the model's are mounted, each under its own name.
ADAPTER_CLAIMS_DIR = "/adapters"
# Slow model loads (a large hf:// download, a cold PVC) must not get the pod killed.
STARTUP_PROBE_PERIOD_SECONDS = 5
STARTUP_TIMEOUT_SECONDS = 30 * 60
GPU_TAINT = "nvidia.com/gpu"


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
        "metadata": object_metadata(owner, adapters_config_map_name(owner.name)),
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


def _tolerations(spec: PagedLLMSpec) -> list[dict[str, Any]]:
    tolerations = [dict(t) for t in spec.scheduling.tolerations]
    # GPU node pools are commonly tainted; a pod asking for GPUs is meant to land there.
    if spec.requests_gpus and not any(t.get("key") == GPU_TAINT for t in tolerations):
        tolerations.append({"key": GPU_TAINT, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def build_pod_template(owner: Owner, spec: PagedLLMSpec) -> dict[str, Any]:
    source = spec.model.source
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, *writable_volumes()]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, *writable_mounts()]
    init_containers: list[dict[str, Any]] = []
    model_path: str | None = None  # the node's built-in demo model
    if source.kind is not ModelSourceKind.DEMO:
        model_volumes, model_mounts, model_path = model_volume(spec)
        volumes += model_volumes
        mounts += model_mounts
        if source.kind is ModelSourceKind.HUGGING_FACE:
            init_containers.append(download_container(spec, MODEL_DIR))
    adapter_volumes, adapter_mounts = _adapter_volumes(owner, spec)
    volumes += adapter_volumes
    mounts += adapter_mounts

    env = writable_dirs_env()
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
    env += api_key_env(spec)
    env += [dict(e) for e in spec.env]

    health = health_check()
    lifecycle, grace_seconds = termination(spec)
    node = container(
        spec,
        CONTAINER_NAME,
        "serve",
        serve_args(spec, model_path),
        env,
        mounts,
        serves_http=True,
        readinessProbe=readiness_probe(health),
        startupProbe={
            "httpGet": health,
            "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS,
            "failureThreshold": STARTUP_TIMEOUT_SECONDS // STARTUP_PROBE_PERIOD_SECONDS,
        },
        lifecycle=lifecycle,
    )
    if spec.resources:
        node["resources"] = dict(spec.resources)

    pod = pod_spec(
        node,
        volumes,
        init_containers,
        # SIGTERM makes the node drain for drainTimeoutSeconds after the preStop pause.
        terminationGracePeriodSeconds=grace_seconds,
        automountServiceAccountToken=False,
    )
    tolerations = _tolerations(spec)
    if tolerations:
        pod["tolerations"] = tolerations
    if spec.scheduling.node_selector:
        pod["nodeSelector"] = dict(spec.scheduling.node_selector)
    if spec.scheduling.affinity:
        pod["affinity"] = spec.scheduling.affinity
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    return pod_template(child_labels(owner.name), pod)


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
    return deployment(
        object_metadata(owner),
        replicas,
        selector_labels(owner.name),
        strategy,
        build_pod_template(owner, spec),
        # Model loads are slow: a rollout is "stuck" only after the startup allowance.
        progressDeadlineSeconds=STARTUP_TIMEOUT_SECONDS + 600,
    )


def build_horizontal_autoscaler(owner: Owner, spec: PagedLLMSpec) -> dict[str, Any]:
    scaling = spec.autoscaling
    assert scaling is not None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_metadata(owner),
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
        "metadata": object_metadata(owner),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }
