"""What the node's and the router's manifests share: the children's names, labels and
metadata, and the pieces of their pods (the pagedllm container, the restricted security, the
writable directories, the model's volume, the SIGTERM drain), each built once here.

Names are deterministic (the PagedLLM's own name), so applying them again finds the same
objects: nothing is ever duplicated, whatever restarts in between.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.operator.spec import API_VERSION, KIND, ModelSourceKind, PagedLLMSpec

OPERATOR_NAME = "pagedllm-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "pagedllm.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
# Tests and the e2e kubelet stand-in run pods as local processes on loopback ports; this pod
# annotation tells the autoscaler which port serves /metrics instead of the container port.
METRICS_PORT_ANNOTATION = "pagedllm.io/metrics-port"

HTTP_PORT = 8000
MODEL_DIR = "/models"
CACHE_DIR = "/var/cache/pagedllm"
HOME_DIR = "/home/pagedllm"
RUN_AS_USER = 1000
# Time for endpoints to drop a stopping pod before it is told to drain.
PRE_STOP_SECONDS = 5

ROUTER_COMPONENT = "router"
ROUTER_APP_NAME = "pagedllm-router"
# Where routers find the demo model's tokenizer (written by an init container).
DEMO_MODEL_SUBDIR = "demo"


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


def object_metadata(
    owner: Owner, name: str | None = None, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """A child's name (the PagedLLM's by default), labels and owner reference."""
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


def container(
    spec: PagedLLMSpec,
    name: str,
    command: str,
    args: list[str],
    env: list[dict[str, Any]],
    mounts: list[dict[str, Any]],
    *,
    serves_http: bool = False,
    **more: Any,
) -> dict[str, Any]:
    """A container of the PagedLLM's image running ``pagedllm COMMAND ARGS`` with the
    restricted security context; ``more`` (probes, resources, lifecycle) follows in order."""
    built: dict[str, Any] = {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["pagedllm", command],
        "args": args,
    }
    if serves_http:
        built["ports"] = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    return {
        **built,
        "env": env,
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        **more,
    }


def health_check() -> dict[str, Any]:
    """``/health`` of the http port: 503 while the pod drains, which takes it out of its
    Service."""
    return {"path": "/health", "port": "http"}


def readiness_probe(health: dict[str, Any]) -> dict[str, Any]:
    return {"httpGet": health, "periodSeconds": 5, "failureThreshold": 2}


def container_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def writable_dirs_env() -> list[dict[str, Any]]:
    # The root filesystem is read-only: the demo model, Hub downloads and anything written
    # under $HOME go to emptyDirs.
    return [
        {"name": "PAGEDLLM_CACHE_DIR", "value": CACHE_DIR},
        {"name": "HOME", "value": HOME_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
    ]


def writable_volumes() -> list[dict[str, Any]]:
    return [
        {"name": "cache", "emptyDir": {}},
        {"name": "home", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]


def writable_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "home", "mountPath": HOME_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]


def download_container(
    spec: PagedLLMSpec, mount_path: str, *, tokenizer_only: bool = False
) -> dict[str, Any]:
    """The init container that fetches an hf:// model (or one GGUF file of it) into the
    "model" volume."""
    args = [
        *(["--tokenizer-only"] if tokenizer_only else []),
        spec.model.source.hub_uri,
        hub_download_dir(spec),
    ]
    env = [*writable_dirs_env(), *[dict(e) for e in spec.env]]
    mounts = [{"name": "model", "mountPath": mount_path}, *writable_mounts()]
    return container(spec, "download", "download", args, env, mounts)


def hub_download_dir(spec: PagedLLMSpec) -> str:
    return f"{MODEL_DIR}/{spec.model.source.path}"


def model_volume(spec: PagedLLMSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """The model's volumes and read-only mounts, and its directory in the container: an
    image path as it is, a claim mounted, or an emptyDir that an init container fills (an
    hf:// download, or the demo model written for routers)."""
    source = spec.model.source
    if source.kind is ModelSourceKind.IMAGE:
        return [], [], source.path
    mount = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
    path = f"{MODEL_DIR}/{source.path or DEMO_MODEL_SUBDIR}"
    if source.kind is ModelSourceKind.HUGGING_FACE and source.file:
        path = f"{hub_download_dir(spec)}/{source.file}"  # the node serves the GGUF file
    if source.kind is ModelSourceKind.PVC:
        claim = {"claimName": source.claim, "readOnly": True}
        return [{"name": "model", "persistentVolumeClaim": claim}], [mount], path
    return [{"name": "model", "emptyDir": {}}], [mount], path


def api_key_env(spec: PagedLLMSpec) -> list[dict[str, Any]]:
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


def termination(spec: PagedLLMSpec) -> tuple[dict[str, Any], int]:
    """The preStop pause (time for endpoints to drop the pod) and the grace period that
    covers it and the drain that SIGTERM starts."""
    lifecycle = {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}}
    return lifecycle, PRE_STOP_SECONDS + spec.drain_timeout_seconds + 5


def pod_spec(
    main: dict[str, Any],
    volumes: list[dict[str, Any]],
    init_containers: list[dict[str, Any]],
    **settings: Any,
) -> dict[str, Any]:
    """A pod of one ``main`` container with the restricted pod security; ``settings``
    (account, grace period) in order after it."""
    spec: dict[str, Any] = {
        "containers": [main],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **settings,
        "enableServiceLinks": False,
    }
    if init_containers:
        spec["initContainers"] = init_containers
    return spec


def pod_template(labels: dict[str, str], spec: dict[str, Any]) -> dict[str, Any]:
    """A pod template that Prometheus scrapes at /metrics."""
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(HTTP_PORT),
        "prometheus.io/path": "/metrics",
    }
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": spec}


def deployment(
    metadata: dict[str, Any],
    replicas: int | None,
    selector: dict[str, str],
    strategy: dict[str, Any],
    template: dict[str, Any],
    **settings: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": strategy,
            **settings,
            "revisionHistoryLimit": 3,
            "template": template,
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
        "metadata": object_metadata(owner),
        "spec": {
            "type": spec.service.type,
            "selector": selector,
            "ports": [
                {"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_disruption_budget(owner: Owner, *, router: bool = False) -> dict[str, Any]:
    selector = router_selector_labels(owner.name) if router else selector_labels(owner.name)
    metadata = (
        object_metadata(owner, router_name(owner.name), router_labels(owner.name))
        if router
        else object_metadata(owner)
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
