"""The PagedLLM spec as plain data: parsed once at the border, trusted everywhere after.

The defaults mirror the CRD's schema defaults (a test holds them equal), so a resource that
reached us without server-side defaulting means the same thing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from pagedllm.config import KV_CACHE_DTYPES, QUANTIZATION_CHOICES
from pagedllm.core.speculative import SpeculativeConfig, parse_speculative_config
from pagedllm.lora.adapter_list import ADAPTER_NAME_MAX as ADAPTER_NAME_MAX
from pagedllm.lora.adapter_list import AdapterListError, parse_adapter_list

GROUP = "pagedllm.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "PagedLLM"
PLURAL = "pagedllms"

DEFAULT_IMAGE = "pagedllm/pagedllm:0.1.0"


class InvalidSpec(Exception):
    """A spec that cannot be served as written; the message tells the user what to fix."""


class ModelSourceKind(str, Enum):
    DEMO = "demo"  # no uri: the node's built-in demo model
    IMAGE = "image"  # a path inside the image
    PVC = "pvc"  # pvc://CLAIM/PATH
    HUGGING_FACE = "hf"  # hf://ORG/NAME[@REVISION][/FILE.gguf]


@dataclass(frozen=True)
class ModelSource:
    kind: ModelSourceKind
    path: str = ""  # inside the image, inside the claim, or the Hub repository id
    claim: str = ""
    revision: str = ""  # of the Hub repository; empty: its default branch
    file: str = ""  # one GGUF file of the Hub repository; empty: the whole repository

    @property
    def hub_uri(self) -> str:
        """The ``hf://`` URI the node's downloader takes."""
        revision = f"@{self.revision}" if self.revision else ""
        file = f"/{self.file}" if self.file else ""
        return f"hf://{self.path}{revision}{file}"


_CLAIM = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?"
_HUB_PART = r"[A-Za-z0-9][-A-Za-z0-9_.]*"
# The revision is matched lazily, so that one holding slashes (refs/pr/1) leaves the file apart.
_HUB_URI = re.compile(
    rf"(?P<repo>{_HUB_PART}/[-A-Za-z0-9_.]+)(@(?P<revision>[-A-Za-z0-9_./]+?))?"
    r"(/(?P<file>[-A-Za-z0-9_.]+\.gguf))?"
)
_HUB_FORMS = "hf://ORG/NAME[@REVISION] or hf://ORG/NAME[@REVISION]/FILE.gguf"


def parse_model_uri(uri: str | None) -> ModelSource:
    if not uri:
        return ModelSource(ModelSourceKind.DEMO)
    if uri.startswith("pvc://"):
        claim, _, path = uri[len("pvc://") :].partition("/")
        if not re.fullmatch(_CLAIM, claim) or not path.strip("/"):
            raise InvalidSpec(f"model uri {uri!r}: expected pvc://CLAIM/PATH")
        return ModelSource(ModelSourceKind.PVC, path=path.strip("/"), claim=claim)
    if uri.startswith("hf://"):
        match = _HUB_URI.fullmatch(uri[len("hf://") :])
        if match is None:
            raise InvalidSpec(f"model uri {uri!r}: expected {_HUB_FORMS}")
        return ModelSource(
            ModelSourceKind.HUGGING_FACE,
            path=match["repo"],
            revision=match["revision"] or "",
            file=match["file"] or "",
        )
    if uri.startswith("/"):
        return ModelSource(ModelSourceKind.IMAGE, path=uri)
    raise InvalidSpec(
        f"model uri {uri!r}: expected an absolute path in the image, pvc://CLAIM/PATH "
        f"or {_HUB_FORMS}"
    )


_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "": 1,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
}


def parse_quantity(value: int | float | str) -> float:
    """A Kubernetes quantity ("4Gi", "500m", 1e9) as a number."""
    if isinstance(value, (int, float)):
        return float(value)
    match = _QUANTITY.match(value.strip())
    if not match:
        raise InvalidSpec(f"{value!r} is not a quantity (e.g. 4Gi, 512Mi, 1000000000)")
    number, suffix = float(match.group(1)), match.group(2) or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * 10 ** int(suffix[1:])


def format_quantity(value: float) -> str:
    """A number as the shortest exact-enough quantity string ("4", "800m")."""
    if float(value).is_integer():
        return str(int(value))
    return f"{math.ceil(value * 1000)}m"


@dataclass(frozen=True)
class ModelSpec:
    served_name: str
    source: ModelSource


@dataclass(frozen=True)
class EngineSpec:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    extra_args: tuple[str, ...] = ()
    speculative: SpeculativeConfig | None = None


class Metric(str, Enum):
    INFLIGHT_REQUESTS = "inflightRequests"
    WAITING_REQUESTS = "waitingRequests"
    KV_CACHE_USAGE = "kvCacheUsage"

    @property
    def prometheus_name(self) -> str:
        """The series each node exports (vLLM's names)."""
        return {
            Metric.INFLIGHT_REQUESTS: "vllm:num_requests_running",
            Metric.WAITING_REQUESTS: "vllm:num_requests_waiting",
            Metric.KV_CACHE_USAGE: "vllm:kv_cache_usage_perc",
        }[self]

    @property
    def custom_metric_name(self) -> str:
        """The name a metrics adapter exposes to HPAs (Prometheus-adapter style: ':' -> '_')."""
        return self.prometheus_name.replace(":", "_")


class AutoscalingMode(str, Enum):
    OPERATOR = "operator"
    HPA = "hpa"


@dataclass(frozen=True)
class AutoscalingSpec:
    max_replicas: int
    target: float
    min_replicas: int = 1
    metric: Metric = Metric.INFLIGHT_REQUESTS
    scale_down_delay_seconds: int = 300
    mode: AutoscalingMode = AutoscalingMode.OPERATOR


@dataclass(frozen=True)
class ServiceSpec:
    type: str = "ClusterIP"
    port: int = 80


@dataclass(frozen=True)
class RolloutSpec:
    strategy: str = "RollingUpdate"
    max_surge: int | str = 1
    max_unavailable: int | str = 0


@dataclass(frozen=True)
class SchedulingSpec:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None


class RouterPolicy(str, Enum):
    """How `pagedllm router` picks a serving pod (its --policy)."""

    PREFIX = "prefix"  # the longest cached prefix, within the load bound
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class RouterSpec:
    """The router Deployment in front of the serving pods (spec.router)."""

    enabled: bool = True
    replicas: int = 2
    policy: RouterPolicy = RouterPolicy.PREFIX
    # No pod gets a request while its load is above this multiple of the mean.
    load_bound: float = 1.25
    # Requests each router holds while no serving pod is ready (scaled to zero, or all pods
    # restarting); 0 answers 503 at once.
    max_held_requests: int = 64
    # How long a held request waits for a ready pod before its 503.
    hold_timeout_seconds: int = 600
    resources: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ObservabilitySpec:
    # An OTLP/HTTP collector for the pods' request traces (--otlp-traces-endpoint).
    otlp_endpoint: str | None = None


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str = "api-key"


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter the pods may serve (spec.adapters[])."""

    name: str
    # An image path, a claim's path or a Hub repository (never the demo model, never a
    # single GGUF file: adapters are PEFT directories).
    source: ModelSource
    # Loaded before a pod reports Ready; the others are loaded once it serves.
    preload: bool = False


@dataclass(frozen=True)
class LoRASpec:
    """spec.lora: the node's LoRA settings (vLLM's names and defaults)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras


@dataclass(frozen=True)
class PagedLLMSpec:
    model: ModelSpec
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    replicas: int | None = None
    resources: dict[str, Any] = field(default_factory=dict)
    engine: EngineSpec = field(default_factory=EngineSpec)
    autoscaling: AutoscalingSpec | None = None
    service: ServiceSpec = field(default_factory=ServiceSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec)
    api_key_secret: SecretKeyRef | None = None
    env: tuple[dict[str, Any], ...] = ()
    drain_timeout_seconds: int = 60
    router: RouterSpec = field(default_factory=RouterSpec)
    observability: ObservabilitySpec = field(default_factory=ObservabilitySpec)
    adapters: tuple[AdapterSpec, ...] = ()
    lora: LoRASpec | None = None

    @property
    def lora_enabled(self) -> bool:
        """LoRA is on with adapters, or with spec.lora alone (so that the first adapter added
        later changes no pod template: no rollout)."""
        return bool(self.adapters) or self.lora is not None

    @property
    def lora_settings(self) -> LoRASpec:
        return self.lora or LoRASpec()

    @property
    def requests_gpus(self) -> bool:
        wanted = {**self.resources.get("requests", {}), **self.resources.get("limits", {})}
        return any(key.endswith("/gpu") for key in wanted)


def _pick(
    raw: Mapping[str, Any], key: str, default: Any, kind: type | tuple[type, ...], where: str
) -> Any:
    value = raw.get(key)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidSpec(f"spec.{where}{key}: {value!r} has the wrong type")
    return value


def _section(raw: Mapping[str, Any], key: str, where: str = "") -> Mapping[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, Mapping):
        raise InvalidSpec(f"spec.{where}{key} must be an object")
    return value


# spec.engine.speculative's keys and vLLM's speculative_config's.
_SPECULATIVE_KEYS = {
    "method": "method",
    "numSpeculativeTokens": "num_speculative_tokens",
    "promptLookupMax": "prompt_lookup_max",
    "promptLookupMin": "prompt_lookup_min",
    "disableByBatchSize": "disable_by_batch_size",
}


def parse_speculative(raw: Any) -> SpeculativeConfig | None:
    """spec.engine.speculative, checked as `pagedllm serve` checks --speculative-config."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise InvalidSpec("spec.engine.speculative must be an object")
    unknown = sorted(set(raw) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise InvalidSpec(
            f"spec.engine.speculative: unknown fields {unknown}; known: {list(_SPECULATIVE_KEYS)}"
        )
    try:
        return parse_speculative_config({_SPECULATIVE_KEYS[k]: v for k, v in raw.items()})
    except ValueError as error:
        message = str(error).replace("speculative_config", "spec.engine.speculative")
        for camel, snake in _SPECULATIVE_KEYS.items():
            message = message.replace(snake, camel)
        raise InvalidSpec(message) from None


def parse_spec(raw: Mapping[str, Any]) -> PagedLLMSpec:
    """Turn the resource's spec into PagedLLMSpec, or raise InvalidSpec saying what is wrong."""
    model_raw = _section(raw, "model")
    served_name = model_raw.get("servedName")
    if not isinstance(served_name, str) or not served_name:
        raise InvalidSpec("spec.model.servedName is required")
    model = ModelSpec(served_name=served_name, source=parse_model_uri(model_raw.get("uri")))

    engine_raw = _section(raw, "engine")
    defaults = EngineSpec()
    kv_cache = engine_raw.get("kvCacheMemory")
    quantization = _pick(engine_raw, "quantization", None, str, "engine.")
    if quantization not in (None, *QUANTIZATION_CHOICES):
        raise InvalidSpec(
            f"spec.engine.quantization: {quantization!r} is not one of "
            f"{', '.join(QUANTIZATION_CHOICES)}"
        )
    kv_cache_dtype = _pick(engine_raw, "kvCacheDtype", defaults.kv_cache_dtype, str, "engine.")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidSpec(
            f"spec.engine.kvCacheDtype: {kv_cache_dtype!r} is not one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    engine = EngineSpec(
        block_size=_pick(engine_raw, "blockSize", defaults.block_size, int, "engine."),
        gpu_memory_utilization=_pick(
            engine_raw, "gpuMemoryUtilization", defaults.gpu_memory_utilization, float, "engine."
        ),
        kv_cache_memory_bytes=int(parse_quantity(kv_cache)) if kv_cache is not None else None,
        max_num_seqs=_pick(engine_raw, "maxNumSeqs", defaults.max_num_seqs, int, "engine."),
        max_num_batched_tokens=_pick(
            engine_raw, "maxNumBatchedTokens", defaults.max_num_batched_tokens, int, "engine."
        ),
        max_model_len=_pick(engine_raw, "maxModelLen", None, int, "engine."),
        dtype=_pick(engine_raw, "dtype", defaults.dtype, str, "engine."),
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=_pick(
            engine_raw, "tensorParallelSize", defaults.tensor_parallel_size, int, "engine."
        ),
        enable_prefix_caching=_pick(
            engine_raw, "enablePrefixCaching", defaults.enable_prefix_caching, bool, "engine."
        ),
        extra_args=tuple(str(arg) for arg in engine_raw.get("extraArgs") or ()),
        speculative=parse_speculative(engine_raw.get("speculative")),
    )

    autoscaling = None
    if raw.get("autoscaling") is not None:
        scaling_raw = _section(raw, "autoscaling")
        if "maxReplicas" not in scaling_raw or "target" not in scaling_raw:
            raise InvalidSpec("spec.autoscaling needs maxReplicas and target")
        try:
            metric = Metric(scaling_raw.get("metric", Metric.INFLIGHT_REQUESTS.value))
            mode = AutoscalingMode(scaling_raw.get("mode", AutoscalingMode.OPERATOR.value))
        except ValueError as error:
            raise InvalidSpec(f"spec.autoscaling: {error}") from None
        autoscaling = AutoscalingSpec(
            min_replicas=_pick(scaling_raw, "minReplicas", 1, int, "autoscaling."),
            max_replicas=_pick(scaling_raw, "maxReplicas", None, int, "autoscaling."),
            metric=metric,
            target=_pick(scaling_raw, "target", None, float, "autoscaling."),
            scale_down_delay_seconds=_pick(
                scaling_raw, "scaleDownDelaySeconds", 300, int, "autoscaling."
            ),
            mode=mode,
        )
        if autoscaling.min_replicas > autoscaling.max_replicas:
            raise InvalidSpec("spec.autoscaling.minReplicas must not exceed maxReplicas")
        if autoscaling.target <= 0:
            raise InvalidSpec("spec.autoscaling.target must be positive")

    service_raw = _section(raw, "service")
    rollout_raw = _section(raw, "rollout")
    rollout_defaults = RolloutSpec()
    scheduling_raw = _section(raw, "scheduling")
    secret_raw = raw.get("apiKeySecretRef")
    replicas = _pick(raw, "replicas", None, int, "")
    if replicas is not None and replicas < 0:
        raise InvalidSpec("spec.replicas must not be negative")

    return PagedLLMSpec(
        router=parse_router(_section(raw, "router")),
        model=model,
        image=_pick(raw, "image", DEFAULT_IMAGE, str, ""),
        image_pull_policy=_pick(raw, "imagePullPolicy", "IfNotPresent", str, ""),
        replicas=replicas,
        resources=dict(_section(raw, "resources")),
        engine=engine,
        autoscaling=autoscaling,
        service=ServiceSpec(
            type=_pick(service_raw, "type", "ClusterIP", str, "service."),
            port=_pick(service_raw, "port", 80, int, "service."),
        ),
        rollout=RolloutSpec(
            strategy=_pick(rollout_raw, "strategy", "RollingUpdate", str, "rollout."),
            max_surge=rollout_raw.get("maxSurge", rollout_defaults.max_surge),
            max_unavailable=rollout_raw.get("maxUnavailable", rollout_defaults.max_unavailable),
        ),
        scheduling=SchedulingSpec(
            node_selector=dict(scheduling_raw.get("nodeSelector") or {}),
            tolerations=tuple(scheduling_raw.get("tolerations") or ()),
            affinity=scheduling_raw.get("affinity"),
            priority_class_name=scheduling_raw.get("priorityClassName"),
        ),
        api_key_secret=SecretKeyRef(name=secret_raw["name"], key=secret_raw.get("key", "api-key"))
        if isinstance(secret_raw, Mapping) and secret_raw.get("name")
        else None,
        env=tuple(raw.get("env") or ()),
        drain_timeout_seconds=_pick(raw, "drainTimeoutSeconds", 60, int, ""),
        observability=parse_observability(_section(raw, "observability")),
        adapters=parse_adapters(raw.get("adapters"), served_name),
        lora=parse_lora(raw.get("lora")),
    )


def parse_adapter_uri(uri: Any, where: str) -> ModelSource:
    """An adapter's uri: the model's grammar, less the demo model and GGUF files."""
    if not isinstance(uri, str) or not uri:
        raise InvalidSpec(f"{where}.uri is required")
    try:
        source = parse_model_uri(uri)
    except InvalidSpec as error:
        raise InvalidSpec(f"{where}.uri: {error}".replace("model uri ", "")) from None
    if source.file or source.path.endswith(".gguf"):
        raise InvalidSpec(
            f"{where}.uri {uri!r}: an adapter is a PEFT directory (adapter_config.json and "
            "adapter_model.safetensors), not a GGUF file"
        )
    return source


def parse_adapters(raw: Any, served_name: str) -> tuple[AdapterSpec, ...]:
    """spec.adapters: the node's adapter list (names valid and unique), none the model's own,
    each uri in the model's grammar."""
    if raw is None:
        return ()
    try:
        listed = parse_adapter_list(raw, "spec.adapters", parse_adapter_uri)
    except AdapterListError as error:
        raise InvalidSpec(str(error)) from None
    for index, adapter in enumerate(listed):
        if adapter.name == served_name:
            raise InvalidSpec(
                f"spec.adapters[{index}].name: {adapter.name!r} is spec.model.servedName, "
                "the base model"
            )
    return tuple(AdapterSpec(a.name, a.uri, a.preload) for a in listed)


def parse_lora(raw: Any) -> LoRASpec | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise InvalidSpec("spec.lora must be an object")
    defaults = LoRASpec()
    lora = LoRASpec(
        max_loras=_pick(raw, "maxLoras", defaults.max_loras, int, "lora."),
        max_lora_rank=_pick(raw, "maxLoraRank", defaults.max_lora_rank, int, "lora."),
        max_cpu_loras=_pick(raw, "maxCpuLoras", None, int, "lora."),
    )
    for key, value in (
        ("maxLoras", lora.max_loras),
        ("maxLoraRank", lora.max_lora_rank),
        ("maxCpuLoras", lora.max_cpu_loras),
    ):
        if value is not None and value < 1:
            raise InvalidSpec(f"spec.lora.{key} must be at least 1")
    if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        raise InvalidSpec("spec.lora.maxCpuLoras must not be below maxLoras")
    return lora


def parse_observability(raw: Mapping[str, Any]) -> ObservabilitySpec:
    endpoint = _pick(raw, "otlpEndpoint", None, str, "observability.")
    if endpoint is not None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc or " " in endpoint:
            raise InvalidSpec(
                f"spec.observability.otlpEndpoint: {endpoint!r} is not an http(s) URL of an "
                "OTLP/HTTP collector (e.g. http://otel-collector.monitoring:4318)"
            )
    return ObservabilitySpec(otlp_endpoint=endpoint)


def parse_router(raw: Mapping[str, Any]) -> RouterSpec:
    defaults = RouterSpec()
    try:
        policy = RouterPolicy(raw.get("policy", defaults.policy.value))
    except ValueError:
        choices = ", ".join(p.value for p in RouterPolicy)
        raise InvalidSpec(
            f"spec.router.policy: {raw.get('policy')!r} is not one of {choices}"
        ) from None
    router = RouterSpec(
        enabled=_pick(raw, "enabled", defaults.enabled, bool, "router."),
        replicas=_pick(raw, "replicas", defaults.replicas, int, "router."),
        policy=policy,
        load_bound=_pick(raw, "loadBound", defaults.load_bound, float, "router."),
        max_held_requests=_pick(raw, "maxHeldRequests", defaults.max_held_requests, int, "router."),
        hold_timeout_seconds=_pick(
            raw, "holdTimeoutSeconds", defaults.hold_timeout_seconds, int, "router."
        ),
        resources=dict(_section(raw, "resources", "router.")),
    )
    if router.replicas < 1:
        raise InvalidSpec(
            "spec.router.replicas must be at least 1 (set spec.router.enabled: false to "
            "serve without routers)"
        )
    if not router.load_bound >= 1.0:
        raise InvalidSpec(
            "spec.router.loadBound must be at least 1.0 (a multiple of the pods' mean load)"
        )
    if router.max_held_requests < 0:
        raise InvalidSpec("spec.router.maxHeldRequests must not be negative")
    if router.hold_timeout_seconds < 1:
        raise InvalidSpec("spec.router.holdTimeoutSeconds must be at least 1")
    return router


def effective_replicas(spec: PagedLLMSpec) -> int:
    """The replicas the Deployment gets: spec.replicas (whoever wrote it through /scale), or
    when it was never written, 1, or with autoscaling the smallest serving count."""
    if spec.replicas is not None:
        replicas = spec.replicas
    elif spec.autoscaling is not None:
        replicas = max(spec.autoscaling.min_replicas, 1)
    else:
        replicas = 1
    if spec.autoscaling is not None:
        replicas = min(max(replicas, spec.autoscaling.min_replicas), spec.autoscaling.max_replicas)
    return replicas
