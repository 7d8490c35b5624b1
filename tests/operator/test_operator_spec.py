"""Parsing the spec at the border: clear errors for what the schema cannot catch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.core.speculative import SpeculativeConfig
from pagedllm.operator.config import OperatorConfig
from pagedllm.operator.spec import (
    InvalidSpec,
    ModelSource,
    ModelSourceKind,
    effective_replicas,
    format_quantity,
    parse_model_uri,
    parse_quantity,
    parse_spec,
)


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (None, ModelSource(ModelSourceKind.DEMO)),
        ("/models/tiny", ModelSource(ModelSourceKind.IMAGE, path="/models/tiny")),
        (
            "pvc://weights/llama/8b/",
            ModelSource(ModelSourceKind.PVC, path="llama/8b", claim="weights"),
        ),
        (
            "hf://Qwen/Qwen2.5-0.5B-Instruct",
            ModelSource(ModelSourceKind.HUGGING_FACE, path="Qwen/Qwen2.5-0.5B-Instruct"),
        ),
        (
            "hf://org/name@v1.0",
            ModelSource(ModelSourceKind.HUGGING_FACE, path="org/name", revision="v1.0"),
        ),
        (
            "hf://bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_K_M.gguf",
            ModelSource(
                ModelSourceKind.HUGGING_FACE,
                path="bartowski/SmolLM2-135M-Instruct-GGUF",
                file="SmolLM2-135M-Instruct-Q4_K_M.gguf",
            ),
        ),
        (
            "hf://org/name@refs/pr/1/model.Q8_0.gguf",
            ModelSource(
                ModelSourceKind.HUGGING_FACE,
                path="org/name",
                revision="refs/pr/1",
                file="model.Q8_0.gguf",
            ),
        ),
    ],
)
def test_model_uris(uri: str | None, expected: ModelSource) -> None:
    assert parse_model_uri(uri) == expected


@pytest.mark.parametrize(
    "uri",
    [
        "pvc://weights",
        "pvc://Bad_Claim/x",
        "hf://org",
        "hf://org/name/extra",
        "hf://org/name/model.safetensors",
        "hf://org/name/dir/model.gguf",
        "hf://org/name@",
        "models/relative",
        "s3://b/k",
    ],
)
def test_bad_model_uris_say_what_is_expected(uri: str) -> None:
    with pytest.raises(InvalidSpec, match="expected"):
        parse_model_uri(uri)


def test_wrong_types_are_reported_with_their_path() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.engine\.maxNumSeqs"):
        parse_spec({"model": {"servedName": "x"}, "engine": {"maxNumSeqs": "many"}})
    with pytest.raises(InvalidSpec, match="servedName is required"):
        parse_spec({"model": {}})
    with pytest.raises(InvalidSpec, match="minReplicas must not exceed"):
        parse_spec(
            {
                "model": {"servedName": "x"},
                "autoscaling": {"minReplicas": 4, "maxReplicas": 2, "target": 1},
            }
        )


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4Gi", 4 * 2**30),
        ("512Mi", 512 * 2**20),
        ("1G", 1e9),
        ("1500m", 1.5),
        ("2e3", 2000),
        (1024, 1024),
    ],
)
def test_quantities(text: str | int, value: float) -> None:
    assert parse_quantity(text) == value


def test_quantity_formatting_round_trips() -> None:
    assert format_quantity(4) == "4"
    assert format_quantity(0.8) == "800m"
    assert parse_quantity(format_quantity(0.25)) == 0.25


@pytest.mark.parametrize(
    ("spec", "replicas"),
    [
        ({}, 1),
        ({"replicas": 0}, 0),
        ({"replicas": 5}, 5),
        ({"autoscaling": {"minReplicas": 0, "maxReplicas": 3, "target": 1}}, 1),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 3, "target": 1}}, 2),
        ({"replicas": 9, "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "target": 1}}, 3),
        ({"replicas": 0, "autoscaling": {"minReplicas": 0, "maxReplicas": 3, "target": 1}}, 0),
    ],
)
def test_effective_replicas(spec: dict, replicas: int) -> None:
    assert effective_replicas(parse_spec({"model": {"servedName": "x"}, **spec})) == replicas


def test_config_from_environment() -> None:
    config = OperatorConfig.from_env({"PAGEDLLM_OPERATOR_RESYNC_SECONDS": "2.5"})
    assert config.resync_seconds == 2.5
    assert config.backoff(0) == 5 and config.backoff(10) == config.backoff_max_seconds
    with pytest.raises(ValueError, match="PAGEDLLM_OPERATOR_RESYNC_SECONDS"):
        OperatorConfig.from_env({"PAGEDLLM_OPERATOR_RESYNC_SECONDS": "soon"})


def test_the_operator_package_stays_light(tmp_path: Path) -> None:
    """The operator image path must not pull in torch (nor shadow the stdlib `operator`)."""
    probe = (
        "import sys, operator, pagedllm.operator; "
        "assert hasattr(operator, 'itemgetter'); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, text=True, capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_speculative_decoding_is_checked_like_the_serve_flag() -> None:
    base = {"model": {"servedName": "m"}}
    spec = parse_spec(
        base
        | {
            "engine": {
                "speculative": {
                    "method": "ngram",
                    "numSpeculativeTokens": 4,
                    "promptLookupMax": 4,
                    "promptLookupMin": 2,
                }
            }
        }
    )
    assert spec.engine.speculative == SpeculativeConfig("ngram", 4, 4, 2)
    assert parse_spec(base).engine.speculative is None
    for bad, message in [
        ({"method": "medusa", "numSpeculativeTokens": 2}, "unknown method 'medusa'"),
        ({"method": "ngram", "numSpeculativeTokens": 40}, "numSpeculativeTokens must be at most"),
        (
            {
                "method": "ngram",
                "numSpeculativeTokens": 2,
                "promptLookupMin": 3,
                "promptLookupMax": 2,
            },
            "promptLookupMin (3) must not exceed promptLookupMax (2)",
        ),
        ({"method": "ngram", "numSpeculativeTokens": 2, "draftModel": "x"}, "unknown fields"),
        ("ngram", "must be an object"),
    ]:
        with pytest.raises(InvalidSpec) as error:
            parse_spec(base | {"engine": {"speculative": bad}})
        assert "spec.engine.speculative" in str(error.value)
        assert message in str(error.value)
