"""The PagedLLM CRD's schema: samples validate, bad resources are rejected with the CRD's own
messages (structural schema via jsonschema, x-kubernetes-validations via cel-python), and the
operator's defaults are the schema's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from pagedllm.operator.spec import InvalidSpec, parse_model_uri, parse_spec
from pagedllm_testing.emulator import crd_validation
from pagedllm_testing.operator_harness import SAMPLES, load_crd

CRD = load_crd()
(VERSION,) = CRD["spec"]["versions"]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def resource(name: str = "demo", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagedllm.io/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"model": {"servedName": "demo"}, **spec},
    }


def errors(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    defaulted = crd_validation.apply_defaults(SCHEMA, obj)
    return [str(e) for e in crd_validation.validate(SCHEMA, defaulted, old)]


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
def test_samples_validate_and_parse(sample: dict[str, Any]) -> None:
    sample = copy.deepcopy(sample)
    sample["metadata"]["namespace"] = "default"
    assert errors(sample) == []
    assert crd_validation.unknown_fields(SCHEMA, sample) == []
    parse_spec(crd_validation.apply_defaults(SCHEMA, sample)["spec"])


def test_operator_defaults_are_the_schema_defaults() -> None:
    bare = resource(
        autoscaling={"maxReplicas": 2, "target": 4}, rollout={}, apiKeySecretRef={"name": "key"}
    )
    defaulted = crd_validation.apply_defaults(SCHEMA, bare)
    assert defaulted["spec"]["engine"]["blockSize"] == 16
    assert defaulted["spec"]["router"] == {
        "enabled": True,
        "replicas": 2,
        "policy": "prefix",
        "loadBound": 1.25,
        "maxHeldRequests": 64,
        "holdTimeoutSeconds": 600,
    }
    assert parse_spec(defaulted["spec"]) == parse_spec(bare["spec"])
    off = crd_validation.apply_defaults(SCHEMA, resource(router={"enabled": False}))
    assert parse_spec(off["spec"]) == parse_spec(resource(router={"enabled": False})["spec"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"autoscaling": {"minReplicas": 3, "maxReplicas": 2, "target": 1}},
            "minReplicas must not exceed maxReplicas",
        ),
        (
            {"autoscaling": {"minReplicas": 0, "maxReplicas": 2, "target": 1, "mode": "hpa"}},
            "mode hpa needs minReplicas >= 1",
        ),
        (
            {"autoscaling": {"maxReplicas": 2, "target": 2, "metric": "kvCacheUsage"}},
            "kvCacheUsage target is a fraction",
        ),
        (
            {"replicas": 2, "autoscaling": {"maxReplicas": 2, "target": 1}},
            "set either replicas or autoscaling, not both",
        ),
        (
            {"rollout": {"strategy": "Recreate", "maxSurge": 1}},
            "maxSurge and maxUnavailable apply to RollingUpdate only",
        ),
        ({"model": {"servedName": "x", "uri": "s3://bucket/model"}}, "does not match"),
        ({"model": {"servedName": "x", "uri": "hf://just-a-name"}}, "does not match"),
        ({"model": {"servedName": "x", "uri": "hf://org/name/model.bin"}}, "does not match"),
        ({"model": {"servedName": "x", "uri": "hf://org/name/a/model.gguf"}}, "does not match"),
        ({"model": {"uri": "/models/x"}}, "'servedName' is a required property"),
        ({"engine": {"gpuMemoryUtilization": 1.5}}, "1.5"),
        ({"engine": {"blockSize": 12}}, "12 is not one of"),
        ({"replicas": -1}, "-1 is less than the minimum of 0"),
        ({"resources": {"limits": {"memory": "lots"}}}, "does not match"),
        ({"router": {"policy": "random"}}, "'random' is not one of"),
        ({"router": {"replicas": 0}}, "0 is less than the minimum of 1"),
        ({"router": {"loadBound": 0.5}}, "0.5 is less than the minimum of 1"),
        ({"router": {"maxHeldRequests": -1}}, "-1 is less than the minimum of 0"),
        ({"router": {"holdTimeoutSeconds": 0}}, "0 is less than the minimum of 1"),
        ({"router": {"enabled": "no"}}, "'no' is not of type 'boolean'"),
        ({"router": {"resources": {"requests": {"cpu": "fast"}}}}, "does not match"),
        ({"observability": {"otlpEndpoint": "collector:4318"}}, "does not match"),
        ({"observability": {"otlpEndpoint": 4318}}, "is not of type 'string'"),
        ({"adapters": [{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]}, "unique"),
        ({"adapters": [{"name": "demo", "uri": "/a"}]}, "must not be named as spec.model"),
        ({"adapters": [{"name": "a b", "uri": "/a"}]}, "does not match"),
        ({"adapters": [{"name": "a", "uri": "hf://org/name/x.gguf"}]}, "does not match"),
        ({"adapters": [{"name": "a"}]}, "'uri' is a required property"),
        ({"lora": {"maxLoras": 0}}, "0 is less than the minimum of 1"),
        ({"lora": {"maxLoras": 4, "maxCpuLoras": 2}}, "maxCpuLoras must not be below maxLoras"),
    ],
)
def test_invalid_specs_are_rejected(spec: dict[str, Any], message: str) -> None:
    found = errors(resource(**spec))
    assert any(message in e for e in found), found


@pytest.mark.parametrize(
    "endpoint",
    ["http://otel-collector.monitoring:4318", "https://otel.example.com/v1/traces"],
)
def test_otlp_endpoints_the_schema_and_the_operator_both_accept(endpoint: str) -> None:
    obj = resource(observability={"otlpEndpoint": endpoint})
    assert errors(obj) == []
    spec = parse_spec(crd_validation.apply_defaults(SCHEMA, obj)["spec"])
    assert spec.observability.otlp_endpoint == endpoint


@pytest.mark.parametrize("endpoint", ["collector:4318", "ftp://collector", "http://"])
def test_otlp_endpoints_the_schema_and_the_operator_both_refuse(endpoint: str) -> None:
    obj = resource(observability={"otlpEndpoint": endpoint})
    assert errors(obj) != []
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
def test_model_uris_the_schema_and_the_operator_both_accept(uri: str) -> None:
    assert errors(resource(model={"servedName": "x", "uri": uri})) == []
    parse_model_uri(uri)  # raises InvalidSpec otherwise


@pytest.mark.parametrize("name", ["x" * 48, "1st-model", "Demo", "demo-"])
def test_names_that_cannot_name_the_children_are_rejected(name: str) -> None:
    assert any("DNS-1035 label" in e for e in errors(resource(name))), name


def test_a_47_character_name_is_fine() -> None:
    assert errors(resource("a" * 47)) == []


def test_the_autoscaler_may_write_replicas_through_scale_later() -> None:
    """Both set is refused when created, allowed on update (the autoscaler writing /scale)."""
    created = resource(autoscaling={"maxReplicas": 3, "target": 2})
    assert errors(created) == []
    scaled = copy.deepcopy(created)
    scaled["spec"]["replicas"] = 2
    old = crd_validation.apply_defaults(SCHEMA, created)
    assert errors(scaled, old=old) == []
    assert errors(scaled) != []


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
