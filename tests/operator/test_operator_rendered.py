"""The children of representative PagedLLMs, rendered exactly as recorded: a change to how the
manifests are built (not to what they hold) must leave every byte of them as it was.

What is recorded is a digest of each case's JSON (keys in the order built, no sort: the order
is part of what must not change), so that the record stays small; the other operator tests say
what the manifests hold. After a deliberate change to them, record again with
``python -P tests/operator/test_operator_rendered.py --write``."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from pagedllm.operator.children import build_children
from pagedllm.operator.spec import effective_replicas, parse_spec
from pagedllm_testing.operator_harness import OWNER, SPECS

RECORDED = Path(__file__).parent / "data" / "rendered_children.json"

ADAPTERS = [
    {"name": "sql", "uri": "pvc://weights/llama/sql", "preload": True},
    {"name": "poet", "uri": "hf://org/poet-lora@v2"},
    {"name": "chat", "uri": "pvc://adapters/chat"},
    {"name": "local", "uri": "/opt/adapters/local"},
]

CASES: dict[str, dict[str, Any]] = {
    **SPECS,
    "router-demo": {"model": {"servedName": "demo"}, "router": {"enabled": True}},
    "router-hf-gguf": {
        "model": {"uri": "hf://org/model-GGUF@main/model-q4_0.gguf", "servedName": "m"},
        "router": {"enabled": True, "replicas": 2, "maxHeldRequests": 0},
        "apiKeySecretRef": {"name": "key", "key": "token"},
        "scheduling": {"priorityClassName": "serving"},
    },
    "router-pvc-lora-gpu": {
        "model": {"uri": "pvc://weights/llama", "servedName": "llama"},
        "replicas": 2,
        "router": {"enabled": True, "policy": "least-load", "resources": {"limits": {"cpu": 1}}},
        "resources": {"requests": {"nvidia.com/gpu": 1, "cpu": "4"}},
        "adapters": ADAPTERS,
        "lora": {"maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 4},
        "engine": {
            "kvCacheDtype": "fp8_e4m3",
            "quantization": "int8",
            "maxModelLen": 4096,
            "speculative": {"method": "ngram", "numSpeculativeTokens": 3},
        },
        "observability": {"otlpEndpoint": "http://otel:4318"},
        "autoscaling": {
            "minReplicas": 0,
            "maxReplicas": 4,
            "target": 8,
            "metric": "waitingRequests",
        },
        "drainTimeoutSeconds": 120,
    },
    "lora-alone": {
        "model": {"uri": "/opt/models/tiny", "servedName": "tiny"},
        "lora": {"maxLoras": 1},
        "engine": {"kvCacheDtype": "int8_per_token_head"},
    },
}


def render() -> dict[str, str]:
    rendered: dict[str, Any] = {}
    for name, raw in CASES.items():
        spec = parse_spec(raw)
        for monitors in (False, True):
            children = build_children(OWNER, spec, effective_replicas(spec), monitors)
            rendered[f"{name} monitors={monitors}"] = digest(
                [*children.wanted, *(vars(ref) for ref in children.unwanted)]
            )
        behind = build_children(OWNER, spec, effective_replicas(spec), False, False)
        rendered[f"{name} routers not in front"] = digest(list(behind.wanted))
    return rendered


def digest(manifests: list[Any]) -> str:
    return hashlib.sha256(json.dumps(manifests).encode()).hexdigest()


def test_the_children_are_rendered_as_recorded() -> None:
    recorded = json.loads(RECORDED.read_text())
    rendered = render()
    assert [case for case in rendered if rendered[case] != recorded.get(case)] == []
    assert rendered.keys() == recorded.keys()


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    RECORDED.write_text(json.dumps(render(), indent=1) + "\n")
