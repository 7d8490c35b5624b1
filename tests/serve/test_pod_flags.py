"""The command line the operator writes into a pod is one the node's own parser accepts, with
the values of the PagedLLM spec: a flag renamed on either side fails here, not in the e2e."""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.cli import build_parser
from pagedllm.operator.children import HTTP_PORT, Owner, build_deployment
from pagedllm.operator.spec import parse_spec
from pagedllm.serve.args import API_KEY_ENV, serve_args
from pagedllm.serve.worker_process import CPUS_ENV

OWNER = Owner(name="llama", namespace="models", uid="0b3a2c1e-0000-4000-8000-000000000002")
ENGINE = {
    "blockSize": 32,
    "gpuMemoryUtilization": 0.75,
    "kvCacheMemory": "64Mi",
    "maxNumSeqs": 12,
    "maxNumBatchedTokens": 512,
    "maxModelLen": 1024,
    "dtype": "bfloat16",
    "tensorParallelSize": 2,
    "enablePrefixCaching": False,
    "extraArgs": ["--api-server-count", "3", "--max-waiting", "40", "--api-server-nice", "4"],
}


def pod_container(spec: dict[str, Any]) -> dict[str, Any]:
    deployment = build_deployment(OWNER, parse_spec(spec), 1)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def parse(container: dict[str, Any]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    assert container["command"][0] == "pagedllm"
    parser = build_parser()
    return parser.parse_args([*container["command"][1:], *container["args"]]), parser


def test_every_engine_field_reaches_the_nodes_flags() -> None:
    container = pod_container(
        {
            "model": {"servedName": "llama-3-8b", "uri": "pvc://weights/llama-3-8b"},
            "engine": ENGINE,
            "apiKeySecretRef": {"name": "llama-key", "key": "token"},
            "drainTimeoutSeconds": 45,
        }
    )
    ns, _ = parse(container)
    assert ns.command == "serve"
    assert ns.model == "/models/llama-3-8b"
    assert ns.served_model_name == ["llama-3-8b"]
    assert (ns.host, ns.port) == ("0.0.0.0", HTTP_PORT)
    assert ns.block_size == 32
    assert ns.gpu_memory_utilization == 0.75
    assert ns.kv_cache_memory == 64 << 20
    assert ns.max_num_seqs == 12
    assert ns.max_num_batched_tokens == 512
    assert ns.max_model_len == 1024
    assert ns.dtype == "bfloat16"
    assert ns.tensor_parallel_size == 2
    assert ns.enable_prefix_caching is False
    assert ns.shutdown_timeout == 45.0
    assert (ns.api_server_count, ns.max_waiting, ns.api_server_nice) == (3, 40, 4)
    # The key and the CPU count come as environment variables the node reads.
    env = {e["name"]: e for e in container["env"]}
    assert env[API_KEY_ENV]["valueFrom"]["secretKeyRef"] == {"name": "llama-key", "key": "token"}
    assert env[CPUS_ENV]["valueFrom"]["resourceFieldRef"]["resource"] == "requests.cpu"


def test_a_demo_pods_command_line_passes_the_nodes_checks() -> None:
    """The whole check `pagedllm serve` makes before starting, on the demo model."""
    container = pod_container(
        {
            "model": {"servedName": "demo"},
            "engine": {**ENGINE, "dtype": "float32", "enablePrefixCaching": True},
        }
    )
    ns, parser = parse(container)
    settings = serve_args(ns, parser)
    engine = settings.engine
    assert engine.model is None
    assert settings.model_names == ["demo"]
    assert (engine.block_size, engine.max_num_seqs, engine.max_num_batched_tokens) == (32, 12, 512)
    assert engine.kv_cache_memory == 64 << 20
    assert engine.gpu_memory_utilization == 0.75
    assert engine.dtype == "float32"
    assert engine.tensor_parallel_size == 2
    assert engine.enable_prefix_caching is True
    assert settings.max_model_len == 1024
    assert settings.shutdown_timeout == 60.0
    assert (settings.api_server_count, settings.max_waiting, settings.api_server_nice) == (3, 40, 4)
