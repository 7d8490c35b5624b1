"""The children builders: pure functions whose output Kubernetes' own schemas accept."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from pagedllm.cli import build_parser
from pagedllm.operator.children import (
    build_children,
    build_deployment,
    build_horizontal_autoscaler,
    serve_args,
)
from pagedllm.operator.spec import InvalidSpec, PagedLLMSpec, effective_replicas, parse_spec
from pagedllm.serve.args import serve_args as cli_serve_args
from pagedllm_testing.operator_harness import OWNER, SPECS

KUBERNETES_VERSION = "1.32"


def children_of(
    raw: dict[str, Any], *, router: bool = True
) -> tuple[PagedLLMSpec, list[dict[str, Any]]]:
    spec = parse_spec({**raw, "router": {"enabled": router}})
    built = build_children(OWNER, spec, effective_replicas(spec), service_monitors_available=False)
    return spec, list(built.wanted)


@pytest.mark.parametrize("name", SPECS)
def test_children_validate_against_kubernetes_schemas(name: str) -> None:
    _, children = children_of(SPECS[name])
    for child in children:
        kubernetes_validate.validate(child, KUBERNETES_VERSION, strict=True)


def test_pure_and_deterministic() -> None:
    assert children_of(SPECS["pvc"]) == children_of(SPECS["pvc"])


def test_which_children_exist_without_the_router() -> None:
    kinds = {
        name: sorted(c["kind"] for c in children_of(raw, router=False)[1])
        for name, raw in SPECS.items()
    }
    assert kinds["demo"] == ["Deployment", "Service"]
    assert kinds["image-path"] == ["Deployment", "PodDisruptionBudget", "Service"]
    assert kinds["hf-gpu-hpa"] == [
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Service",
    ]
    spec = parse_spec({**SPECS["demo"], "router": {"enabled": False}})
    with_monitor = build_children(OWNER, spec, 1, service_monitors_available=True)
    assert [c["kind"] for c in with_monitor.wanted][-1] == "ServiceMonitor"
    # What the router (and LoRA) would add is taken away.
    assert {r.kind for r in with_monitor.unwanted} == {
        "ConfigMap",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "Deployment",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    }
    assert {
        (r.kind, r.name) for r in with_monitor.unwanted if r.kind in ("Deployment", "Service")
    } == {("Deployment", "llama-router"), ("Service", "llama-serving")}


def test_serve_flags_follow_the_engine_spec() -> None:
    spec = parse_spec(SPECS["hf-gpu-hpa"])
    args = serve_args(spec, "/models/meta-llama/Llama-3.1-8B")

    def flag(name: str) -> str:
        return args[args.index(name) + 1]

    assert flag("--model") == "/models/meta-llama/Llama-3.1-8B"
    assert flag("--tensor-parallel-size") == "2"
    assert flag("--kv-cache-memory") == str(8 * 2**30)
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert args[-2:] == ["--seed", "1"]
    assert "--max-model-len" not in args


def test_the_kv_cache_dtype_reaches_the_serve_flag_and_is_checked() -> None:
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        spec = parse_spec({"model": {"servedName": "m"}, "engine": {"kvCacheDtype": name}})
        args = serve_args(spec, None)
        assert args[args.index("--kv-cache-dtype") + 1] == name
        parsed = build_parser().parse_args(["serve", *args])
        assert cli_serve_args(parsed, build_parser()).engine.kv_cache_dtype == name
    # auto (the default) adds no flag: the pod templates of earlier releases stay as they were.
    assert "--kv-cache-dtype" not in serve_args(parse_spec(SPECS["demo"]), None)
    with pytest.raises(InvalidSpec, match=r"spec.engine.kvCacheDtype: 'int4' is not one of"):
        parse_spec({"model": {"servedName": "m"}, "engine": {"kvCacheDtype": "int4"}})


def test_speculative_decoding_reaches_the_serve_flag() -> None:
    speculative = {
        "method": "ngram",
        "numSpeculativeTokens": 3,
        "promptLookupMin": 2,
        "disableByBatchSize": 8,
    }
    spec = parse_spec({"model": {"servedName": "m"}, "engine": {"speculative": speculative}})
    args = serve_args(spec, None)
    flag = json.loads(args[args.index("--speculative-config") + 1])
    assert flag == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 2,
        "prompt_lookup_min": 2,
        "disable_by_batch_size": 8,
    }
    assert "--speculative-config" not in serve_args(parse_spec(SPECS["demo"]), None)


def test_the_otlp_endpoint_reaches_the_serving_container() -> None:
    raw = {**SPECS["demo"], "observability": {"otlpEndpoint": "http://otel.monitoring:4318"}}
    container = build_deployment(OWNER, parse_spec(raw), 1)["spec"]["template"]["spec"][
        "containers"
    ][0]
    args = container["args"]
    assert args[args.index("--otlp-traces-endpoint") + 1] == "http://otel.monitoring:4318"
    plain = build_deployment(OWNER, parse_spec(SPECS["demo"]), 1)
    assert (
        "--otlp-traces-endpoint" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_demo_model_has_no_model_flag_and_image_path_is_used_as_is() -> None:
    demo = build_deployment(OWNER, parse_spec(SPECS["demo"]), 1)
    assert "--model" not in demo["spec"]["template"]["spec"]["containers"][0]["args"]
    image = build_deployment(OWNER, parse_spec(SPECS["image-path"]), 3)
    args = image["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/opt/models/tiny"
    assert image["spec"]["strategy"] == {"type": "Recreate"}


def test_pvc_model_is_mounted_read_only() -> None:
    pod = build_deployment(OWNER, parse_spec(SPECS["pvc"]), 1)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models/llama/8b"
    assert pod["nodeSelector"] == {"gpu": "l4"} and pod["priorityClassName"] == "serving"


@pytest.mark.parametrize(
    ("uri", "download", "model"),
    [
        (
            "hf://meta-llama/Llama-3.1-8B",
            ["hf://meta-llama/Llama-3.1-8B", "/models/meta-llama/Llama-3.1-8B"],
            "/models/meta-llama/Llama-3.1-8B",
        ),
        (
            "hf://org/repo-GGUF@v2/model.Q4_K_M.gguf",
            ["hf://org/repo-GGUF@v2/model.Q4_K_M.gguf", "/models/org/repo-GGUF"],
            "/models/org/repo-GGUF/model.Q4_K_M.gguf",
        ),
    ],
)
def test_a_hub_model_is_downloaded_before_the_node_starts(
    uri: str, download: list[str], model: str
) -> None:
    raw = {"model": {"uri": uri, "servedName": "m"}}
    pod = build_deployment(OWNER, parse_spec(raw), 1)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["pagedllm", "download"] and init["args"] == download
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == model


def test_writable_dirs_for_a_read_only_root() -> None:
    pod = build_deployment(OWNER, parse_spec(SPECS["demo"]), 1)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert env["PAGEDLLM_CACHE_DIR"] in mounts and env["HOME"] in mounts and "/tmp" in mounts
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False


def test_hpa_scales_the_pagedllm_not_the_deployment() -> None:
    hpa = build_horizontal_autoscaler(OWNER, parse_spec(SPECS["hf-gpu-hpa"]))
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "PagedLLM"
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 6
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "750m"
