"""The PagedLLM CRD's schema, held by the real kube-apiserver (server-side dry-run through the
built kubectl): samples validate, bad resources are refused with the schema's and each CEL rule's
own messages, the apiserver's defaults are the operator's, and the autoscaler may write replicas
through /scale."""

from __future__ import annotations

import copy
import json
import subprocess
import uuid
from typing import Any

import pytest
import yaml

from pagedllm.operator.spec import InvalidSpec, parse_model_uri, parse_spec
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.operator_harness import CRD_PATH, ROUTER_DEFAULTS, SAMPLES, load_crd

CRD = load_crd()
(VERSION,) = CRD["spec"]["versions"]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    """The control plane with the CRD installed and a namespace of this module's."""
    control_plane.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
    control_plane.kubectl(
        "wait", "--for=condition=Established", "crd/pagedllms.pagedllm.io", "--timeout=60s"
    )
    return control_plane


@pytest.fixture
def namespace(cluster: ControlPlane) -> str:
    name = f"crd-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    return name


def resource(name: str = "demo", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagedllm.io/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"model": {"servedName": "demo"}, **spec},
    }


def submit(cluster: ControlPlane, obj: dict[str, Any], *verb: str) -> subprocess.CompletedProcess:
    return cluster.kubectl(*verb, "-o", "json", "-f", "-", stdin=json.dumps(obj), check=False)


def dry_run(cluster: ControlPlane, obj: dict[str, Any]) -> subprocess.CompletedProcess:
    """``kubectl create --dry-run=server``: admission, the schema, CEL and defaults, nothing
    stored."""
    return submit(cluster, obj, "create", "--dry-run=server")


def errors(cluster: ControlPlane, obj: dict[str, Any]) -> str:
    """What the apiserver refuses ``obj`` with ("" when it accepts it)."""
    result = dry_run(cluster, obj)
    return "" if result.returncode == 0 else result.stderr


def defaulted(cluster: ControlPlane, obj: dict[str, Any]) -> dict[str, Any]:
    result = dry_run(cluster, obj)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def sample_pagedllms() -> list[dict[str, Any]]:
    found = []
    for path in sorted(SAMPLES.glob("*.yaml")):
        found += [
            d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "PagedLLM"
        ]
    return found


def test_there_is_a_cpu_demo_and_a_gpu_sample() -> None:
    samples = sample_pagedllms()
    assert any("uri" not in s["spec"]["model"] for s in samples)
    assert any(
        "nvidia.com/gpu" in s["spec"].get("resources", {}).get("limits", {}) for s in samples
    )


@pytest.mark.parametrize("sample", sample_pagedllms(), ids=lambda s: s["metadata"]["name"])
def test_samples_validate_and_parse(cluster: ControlPlane, sample: dict[str, Any]) -> None:
    sample = copy.deepcopy(sample)
    sample["metadata"]["namespace"] = "default"
    # --validate=strict: an unknown field is an error, not a warning.
    result = submit(cluster, sample, "create", "--dry-run=server", "--validate=strict")
    assert result.returncode == 0, result.stderr
    parse_spec(json.loads(result.stdout)["spec"])


def test_an_unknown_field_is_refused_under_strict_validation(cluster: ControlPlane) -> None:
    typo = resource(engine={"blokSize": 16})
    result = submit(cluster, typo, "create", "--dry-run=server", "--validate=strict")
    assert result.returncode != 0
    assert 'unknown field "spec.engine.blokSize"' in result.stderr


def test_operator_defaults_are_the_schema_defaults(cluster: ControlPlane) -> None:
    bare = resource(
        autoscaling={"maxReplicas": 2, "target": 4}, rollout={}, apiKeySecretRef={"name": "key"}
    )
    stored = defaulted(cluster, bare)
    assert stored["spec"]["engine"]["blockSize"] == 16
    assert stored["spec"]["router"] == ROUTER_DEFAULTS
    assert parse_spec(stored["spec"]) == parse_spec(bare["spec"])
    off = defaulted(cluster, resource(router={"enabled": False}))
    assert parse_spec(off["spec"]) == parse_spec(resource(router={"enabled": False})["spec"])


# Each CEL rule (x-kubernetes-validations) once, with its message, then the schema's checks.
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"autoscaling": {"minReplicas": 3, "maxReplicas": 2, "target": 1}},
            "spec.autoscaling: Invalid value: minReplicas must not exceed maxReplicas",
        ),
        (
            {"autoscaling": {"minReplicas": 0, "maxReplicas": 2, "target": 1, "mode": "hpa"}},
            "spec.autoscaling: Invalid value: mode hpa needs minReplicas >= 1",
        ),
        (
            {"autoscaling": {"maxReplicas": 2, "target": 2, "metric": "kvCacheUsage"}},
            "spec.autoscaling: Invalid value: the kvCacheUsage target is a fraction",
        ),
        (
            {"replicas": 2, "autoscaling": {"maxReplicas": 2, "target": 1}},
            "spec: Invalid value: set either replicas or autoscaling, not both",
        ),
        (
            {"rollout": {"strategy": "Recreate", "maxSurge": 1}},
            "spec.rollout: Invalid value: maxSurge and maxUnavailable apply to RollingUpdate only",
        ),
        (
            {"adapters": [{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]},
            "spec.adapters: Invalid value: adapter names must be unique",
        ),
        (
            {"adapters": [{"name": "demo", "uri": "/a"}]},
            "spec: Invalid value: an adapter must not be named as spec.model.servedName",
        ),
        (
            {"lora": {"maxLoras": 4, "maxCpuLoras": 2}},
            "spec: Invalid value: spec.lora.maxCpuLoras must not be below maxLoras",
        ),
        (
            {
                "engine": {
                    "speculative": {
                        "method": "ngram",
                        "numSpeculativeTokens": 3,
                        "promptLookupMin": 5,
                        "promptLookupMax": 2,
                    }
                }
            },
            "spec.engine.speculative: Invalid value: promptLookupMin must not exceed "
            "promptLookupMax",
        ),
        (
            {"model": {"servedName": "x", "uri": "s3://bucket/model"}},
            "spec.model.uri in body should match",
        ),
        (
            {"model": {"servedName": "x", "uri": "hf://just-a-name"}},
            "spec.model.uri in body should match",
        ),
        (
            {"model": {"servedName": "x", "uri": "hf://org/name/model.bin"}},
            "spec.model.uri in body should match",
        ),
        (
            {"model": {"servedName": "x", "uri": "hf://org/name/a/model.gguf"}},
            "spec.model.uri in body should match",
        ),
        ({"model": {"uri": "/models/x"}}, "spec.model.servedName: Required value"),
        ({"engine": {"gpuMemoryUtilization": 1.5}}, "should be less than or equal to 1"),
        (
            {"engine": {"blockSize": 12}},
            'spec.engine.blockSize: Unsupported value: 12: supported values: "8", "16"',
        ),
        ({"replicas": -1}, "spec.replicas in body should be greater than or equal to 0"),
        (
            {"resources": {"limits": {"memory": "lots"}}},
            "spec.resources.limits.memory in body should match",
        ),
        ({"router": {"policy": "random"}}, 'spec.router.policy: Unsupported value: "random"'),
        (
            {"router": {"replicas": 0}},
            "spec.router.replicas in body should be greater than or equal to 1",
        ),
        (
            {"router": {"loadBound": 0.5}},
            "spec.router.loadBound in body should be greater than or equal to 1",
        ),
        (
            {"router": {"maxHeldRequests": -1}},
            "spec.router.maxHeldRequests in body should be greater than or equal to 0",
        ),
        (
            {"router": {"holdTimeoutSeconds": 0}},
            "spec.router.holdTimeoutSeconds in body should be greater than or equal to 1",
        ),
        ({"router": {"enabled": "no"}}, "spec.router.enabled in body must be of type boolean"),
        (
            {"router": {"resources": {"requests": {"cpu": "fast"}}}},
            "spec.router.resources.requests.cpu in body should match",
        ),
        (
            {"observability": {"otlpEndpoint": "collector:4318"}},
            "spec.observability.otlpEndpoint in body should match",
        ),
        (
            {"observability": {"otlpEndpoint": 4318}},
            "spec.observability.otlpEndpoint in body must be of type string",
        ),
        (
            {"adapters": [{"name": "a b", "uri": "/a"}]},
            "spec.adapters[0].name in body should match",
        ),
        (
            {"adapters": [{"name": "a", "uri": "hf://org/name/x.gguf"}]},
            "spec.adapters[0].uri in body should match",
        ),
        ({"adapters": [{"name": "a"}]}, "spec.adapters[0].uri: Required value"),
        (
            {"lora": {"maxLoras": 0}},
            "spec.lora.maxLoras in body should be greater than or equal to 1",
        ),
    ],
)
def test_invalid_specs_are_rejected(
    cluster: ControlPlane, spec: dict[str, Any], message: str
) -> None:
    found = errors(cluster, resource(**spec))
    assert " is invalid" in found, found
    assert message in found, found


@pytest.mark.parametrize(
    "endpoint",
    ["http://otel-collector.monitoring:4318", "https://otel.example.com/v1/traces"],
)
def test_otlp_endpoints_the_schema_and_the_operator_both_accept(
    cluster: ControlPlane, endpoint: str
) -> None:
    obj = resource(observability={"otlpEndpoint": endpoint})
    spec = parse_spec(defaulted(cluster, obj)["spec"])
    assert spec.observability.otlp_endpoint == endpoint


@pytest.mark.parametrize("endpoint", ["collector:4318", "ftp://collector", "http://"])
def test_otlp_endpoints_the_schema_and_the_operator_both_refuse(
    cluster: ControlPlane, endpoint: str
) -> None:
    obj = resource(observability={"otlpEndpoint": endpoint})
    assert "spec.observability.otlpEndpoint" in errors(cluster, obj)
    with pytest.raises(InvalidSpec, match="observability.otlpEndpoint"):
        parse_spec(obj["spec"])


@pytest.mark.parametrize(
    "uri",
    [
        "hf://org/name",
        "hf://org/name@main",
        "hf://org/name/model-Q4_K_M.gguf",
        "hf://org/name@refs/pr/1/model.gguf",
        "/models/smollm2.gguf",
    ],
)
def test_model_uris_the_schema_and_the_operator_both_accept(
    cluster: ControlPlane, uri: str
) -> None:
    assert errors(cluster, resource(model={"servedName": "x", "uri": uri})) == ""
    parse_model_uri(uri)  # raises InvalidSpec otherwise


@pytest.mark.parametrize("name", ["x" * 48, "1st-model", "demo-"])
def test_names_that_cannot_name_the_children_are_rejected(cluster: ControlPlane, name: str) -> None:
    found = errors(cluster, resource(name))
    assert "metadata.name must be a DNS-1035 label" in found, found


def test_an_upper_case_name_is_refused_by_kubernetes_itself(cluster: ControlPlane) -> None:
    # Every object name is a DNS-1123 subdomain, checked before the CRD's own rule runs.
    assert "a lowercase RFC 1123 subdomain" in errors(cluster, resource("Demo"))


def test_a_47_character_name_is_fine(cluster: ControlPlane) -> None:
    assert errors(cluster, resource("a" * 47)) == ""


def test_the_autoscaler_may_write_replicas_through_scale_later(
    cluster: ControlPlane, namespace: str
) -> None:
    """Both set is refused when created, allowed on update (the autoscaler writing /scale)."""
    created = resource(autoscaling={"maxReplicas": 3, "target": 2})
    created["metadata"]["namespace"] = namespace
    both = copy.deepcopy(created)
    both["spec"]["replicas"] = 2
    assert "set either replicas or autoscaling" in errors(cluster, both)
    assert submit(cluster, created, "create").returncode == 0
    scaled = cluster.kubectl("-n", namespace, "scale", "pllm/demo", "--replicas=2", check=False)
    assert scaled.returncode == 0, scaled.stderr
    stored = json.loads(cluster.kubectl("-n", namespace, "get", "pllm/demo", "-o", "json").stdout)
    assert stored["spec"]["replicas"] == 2 and "autoscaling" in stored["spec"]


def test_scale_status_and_printer_columns() -> None:
    assert VERSION["subresources"]["status"] == {}
    assert VERSION["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in VERSION["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Model", "Ready", "Replicas", "URL", "Age"]
    assert CRD["spec"]["names"]["shortNames"] == ["pllm"]
    # No schema default for replicas: unset means "not decided by the user" (see /scale).
    assert "default" not in SCHEMA["properties"]["spec"]["properties"]["replicas"]


def _untyped(schema: dict[str, Any], path: str = "") -> list[str]:
    found = []
    if not ({"type", "x-kubernetes-int-or-string"} & set(schema)):
        found.append(path or ".")
    for name, sub in (schema.get("properties") or {}).items():
        found += _untyped(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        found += _untyped(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        found += _untyped(schema["additionalProperties"], f"{path}{{}}")
    return found


def test_schema_is_structural_and_described() -> None:
    assert _untyped(SCHEMA) == []
    spec = SCHEMA["properties"]["spec"]["properties"]
    undocumented = [
        name
        for name, sub in spec.items()
        if "description" not in sub
        and sub.get("type") == "object"
        and name not in ("service", "scheduling")
    ]
    assert undocumented == []
