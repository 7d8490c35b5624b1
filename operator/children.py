"""The objects a PagedLLM owns, built by pure functions: spec in, manifests out.

Names are deterministic (the PagedLLM's own name), so applying them again finds the same
objects: nothing is ever duplicated, whatever restarts in between.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.operator.spec import (
    API_VERSION,
    KIND,
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
RUN_AS_USER = 1000
# Time for endpoints to drop a stopping pod before it is told to drain.
PRE_STOP_SECONDS = 5
# Slow model loads (a large hf:// download, a cold PVC) must not get the pod killed.
STARTUP_PROBE_PERIOD_SECONDS = 5
STARTUP_TIMEOUT_SECONDS = 30 * 60
GPU_TAINT = "nvidia.com/gpu"


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


def service_url(owner: Owner, spec: PagedLLMSpec) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.service.port}"


def _metadata(owner: Owner) -> dict[str, Any]:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": child_labels(owner.name),
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
    return args + list(engine.extra_args)


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
    model_path: str | None
    if source.kind is ModelSourceKind.DEMO:
        model_path = None
    elif source.kind is ModelSourceKind.IMAGE:
        model_path = source.path
    elif source.kind is ModelSourceKind.PVC:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
        model_path = f"{MODEL_DIR}/{source.path}"
    else:
        volumes.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
        download_dir = f"{MODEL_DIR}/{source.path}"
        model_path = f"{download_dir}/{source.file}" if source.file else download_dir
        init_containers.append(
            {
                "name": "download",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": ["pagedllm", "download"],
                "args": [source.hub_uri, download_dir],
                "env": [*_writable_dirs_env(), *[dict(e) for e in spec.env]],
                "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR}, *_writable_mounts()],
                "securityContext": _container_security_context(),
            }
        )

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
    if spec.api_key_secret is not None:
        env.append(
            {
                "name": "PAGEDLLM_API_KEY",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": spec.api_key_secret.name,
                        "key": spec.api_key_secret.key,
                    }
                },
            }
        )
    env += [dict(e) for e in spec.env]

    health = {"path": "/health", "port": "http"}
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
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}},
    }
    if spec.resources:
        container["resources"] = dict(spec.resources)

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # SIGTERM makes the node drain for drainTimeoutSeconds after the preStop pause.
        "terminationGracePeriodSeconds": PRE_STOP_SECONDS + spec.drain_timeout_seconds + 5,
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
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(HTTP_PORT),
                "prometheus.io/path": "/metrics",
            },
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


def build_service(owner: Owner, spec: PagedLLMSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {
            "type": spec.service.type,
            "selector": selector_labels(owner.name),
            "ports": [
                {"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_disruption_budget(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner),
        "spec": {
            # One pod at a time may be evicted (node drains, cluster-autoscaler scale-downs).
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(owner.name)},
            # A pod that never got ready must not block draining its node.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


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
    owner: Owner, spec: PagedLLMSpec, replicas: int, service_monitors_available: bool
) -> Children:
    wanted = [build_deployment(owner, spec, replicas), build_service(owner, spec)]
    unwanted = []
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
    return Children(wanted=tuple(wanted), unwanted=tuple(unwanted))
