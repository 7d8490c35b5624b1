"""LoRA adapters in the PagedLLM: spec.adapters and spec.lora checked at the border, the
adapters' ConfigMap and the pod template built from them (a changed list is no rollout, a new
claim is), status.adapters from the pods' metrics, and the operator creating the ConfigMap."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from pagedllm.operator.children import (
    ADAPTERS_DIR,
    build_adapters_config_map,
    build_children,
    build_deployment,
)
from pagedllm.operator.pod_metrics import served_adapters
from pagedllm.operator.spec import InvalidSpec, LoRASpec, parse_spec
from pagedllm.operator.status import Observed, adapters_status, compute_status
from pagedllm_testing.operator_harness import OWNER, Kube, eventually, pagedllm, pllm_path

KUBERNETES_VERSION = "1.32"
SQL = {"name": "sql", "uri": "/opt/adapters/sql", "preload": True}
POET = {"name": "poet", "uri": "hf://org/poet-lora@v2"}


def spec_with(adapters: list[dict[str, Any]] | None = None, **more: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"model": {"servedName": "llama", "uri": "pvc://weights/llama"}}
    if adapters is not None:
        raw["adapters"] = adapters
    return {**raw, **more}


def pod_of(raw: dict[str, Any]) -> dict[str, Any]:
    return build_deployment(OWNER, parse_spec(raw), 1)["spec"]["template"]


@pytest.mark.parametrize(
    ("adapters", "lora", "message"),
    [
        ([{"name": "bad name", "uri": "/a"}], None, "spec.adapters[0].name: 'bad name' is not"),
        ([{"name": "-a", "uri": "/a"}], None, "is not an adapter name"),
        ([{"name": "a" * 129, "uri": "/a"}], None, "at most 128"),
        ([{"name": "llama", "uri": "/a"}], None, "is spec.model.servedName"),
        ([SQL, {**SQL, "uri": "/b"}], None, "spec.adapters[1].name: 'sql' is given twice"),
        ([{"name": "a"}], None, "spec.adapters[0].uri is required"),
        ([{"name": "a", "uri": "s3://bucket/a"}], None, "spec.adapters[0].uri: 's3://bucket/a'"),
        ([{"name": "a", "uri": "hf://org/name/x.gguf"}], None, "not a GGUF file"),
        ([{"name": "a", "uri": "/a/x.gguf"}], None, "not a GGUF file"),
        ([{"name": "a", "uri": "pvc://Bad/a"}], None, "expected pvc://CLAIM/PATH"),
        ([{"name": "a", "uri": "/a", "preload": "yes"}], None, "adapters[0].preload"),
        ([{"name": "a", "uri": "/a", "rank": 8}], None, "unknown fields ['rank']"),
        ({"name": "a"}, None, "spec.adapters must be a list"),
        (None, {"maxLoras": 0}, "spec.lora.maxLoras must be at least 1"),
        (None, {"maxLoraRank": -8}, "spec.lora.maxLoraRank must be at least 1"),
        (None, {"maxLoras": 4, "maxCpuLoras": 2}, "maxCpuLoras must not be below maxLoras"),
        (None, {"maxLoras": "4"}, "spec.lora.maxLoras: '4' has the wrong type"),
        (None, [4], "spec.lora must be an object"),
    ],
)
def test_bad_adapters_and_settings_are_refused_with_the_field(
    adapters: Any, lora: Any, message: str
) -> None:
    raw = spec_with(adapters)
    if lora is not None:
        raw["lora"] = lora
    with pytest.raises(InvalidSpec) as error:
        parse_spec(raw)
    assert message in str(error.value)


def test_lora_is_on_with_adapters_or_settings() -> None:
    assert not parse_spec(spec_with()).lora_enabled
    assert parse_spec(spec_with([SQL])).lora_settings == LoRASpec(1, 16, None)
    alone = parse_spec(spec_with(lora={"maxLoras": 4, "maxCpuLoras": 8}))
    assert alone.lora_enabled and alone.adapters == ()
    assert alone.lora_settings == LoRASpec(max_loras=4, max_lora_rank=16, max_cpu_loras=8)


def test_the_config_map_lists_where_the_node_finds_each_adapter() -> None:
    spec = parse_spec(
        spec_with(
            [
                SQL,
                POET,
                {"name": "same-claim", "uri": "pvc://weights/adapters/a"},
                {"name": "other-claim", "uri": "pvc://tuned/b"},
            ]
        )
    )
    config_map = build_adapters_config_map(OWNER, spec)
    kubernetes_validate.validate(config_map, KUBERNETES_VERSION, strict=True)
    assert config_map["metadata"]["name"] == f"{OWNER.name}-adapters"
    assert json.loads(config_map["data"]["adapters.json"]) == [
        {"name": "sql", "uri": "/opt/adapters/sql", "preload": True},
        {"name": "poet", "uri": "hf://org/poet-lora@v2", "preload": False},
        {"name": "same-claim", "uri": "/models/adapters/a", "preload": False},
        {"name": "other-claim", "uri": "/adapters/tuned/b", "preload": False},
    ]


def test_the_pods_mount_the_list_and_run_with_the_lora_flags() -> None:
    template = pod_of(spec_with([SQL], lora={"maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 4}))
    pod = template["spec"]
    (container,) = pod["containers"]
    assert {"name": "adapters", "configMap": {"name": f"{OWNER.name}-adapters"}} in pod["volumes"]
    assert {"name": "adapters", "mountPath": ADAPTERS_DIR, "readOnly": True} in container[
        "volumeMounts"
    ]
    args = container["args"]
    assert args[args.index("--enable-lora") :][:9] == [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "32",
        "--max-cpu-loras",
        "4",
        "--lora-modules-file",
        f"{ADAPTERS_DIR}/adapters.json",
    ]
    assert "--lora-modules" not in args  # the adapters are in the file, not the template
    plain = pod_of(spec_with())["spec"]
    assert "--enable-lora" not in plain["containers"][0]["args"]
    assert all(v["name"] != "adapters" for v in plain["volumes"])


def test_a_changed_list_changes_no_template_but_a_new_claim_does() -> None:
    one = pod_of(spec_with([SQL]))
    assert pod_of(spec_with([SQL, POET, {"name": "c", "uri": "pvc://weights/c"}])) == one
    assert pod_of(spec_with([POET])) == one
    claimed = pod_of(spec_with([SQL, {"name": "c", "uri": "pvc://tuned/c"}]))
    assert claimed != one
    pod = claimed["spec"]
    (volume,) = [
        v
        for v in pod["volumes"]
        if (v.get("persistentVolumeClaim") or {}).get("claimName") == "tuned"
    ]
    assert volume["persistentVolumeClaim"] == {"claimName": "tuned", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": "/adapters/tuned", "readOnly": True}
    kubernetes_validate.validate(
        build_deployment(OWNER, parse_spec(spec_with([{"name": "c", "uri": "pvc://tuned/c"}])), 1),
        KUBERNETES_VERSION,
        strict=True,
    )


def test_the_config_map_comes_before_the_deployment_and_goes_with_lora() -> None:
    on = build_children(OWNER, parse_spec(spec_with([SQL])), 1, False)
    kinds = [child["kind"] for child in on.wanted]
    assert kinds.index("ConfigMap") < kinds.index("Deployment")
    off = build_children(OWNER, parse_spec(spec_with()), 1, False)
    assert "ConfigMap" not in [child["kind"] for child in off.wanted]
    assert ("ConfigMap", f"{OWNER.name}-adapters") in {(r.kind, r.name) for r in off.unwanted}


def test_the_pods_metrics_say_which_adapters_they_serve() -> None:
    text = (
        "# TYPE pagedllm:lora_adapter_served gauge\n"
        'pagedllm:lora_adapter_served{adapter="sql",model_name="llama"} 1.0\n'
        'pagedllm:lora_adapter_served{adapter="old",model_name="llama"} 0.0\n'
    )
    assert served_adapters(text) == frozenset({"sql"})
    assert served_adapters("# TYPE vllm:num_requests_running gauge\n") is None
    with pytest.raises(ValueError):
        served_adapters("pagedllm:lora_adapter_served{adapter=")


def test_status_counts_the_pods_serving_each_adapter() -> None:
    served = [frozenset({"sql", "poet"}), frozenset({"sql"})]
    assert adapters_status(["sql", "poet", "new"], served) == [
        {"name": "sql", "loadedPods": 2},
        {"name": "poet", "loadedPods": 1},
        {"name": "new", "loadedPods": 0},
    ]
    # No adapters in the spec: the field is removed (a merge patch of null).
    status = compute_status(
        generation=1,
        desired=1,
        url="u",
        selector="s",
        observed=Observed(None, [], served_adapters=served),
        previous={},
        now="T",
    )
    assert status["adapters"] is None


@pytest.mark.usefixtures("crd", "operator_process")
def test_the_operator_keeps_the_list_and_the_status(kube: Kube, namespace: str) -> None:
    """The operator writes the adapters' ConfigMap, status.adapters, follows a changed list and
    puts back a ConfigMap deleted by hand."""
    kube.create(
        pllm_path(namespace),
        pagedllm(
            "tuned",
            {"model": {"servedName": "base"}, "adapters": [SQL], "router": {"enabled": False}},
        ),
    )
    path = f"/api/v1/namespaces/{namespace}/configmaps/tuned-adapters"
    config_map = eventually(lambda: kube.get(path), what="the adapters' ConfigMap")
    assert json.loads(config_map["data"]["adapters.json"])[0]["name"] == "sql"
    eventually(
        lambda: (
            (kube.get(f"{pllm_path(namespace)}/tuned") or {}).get("status", {}).get("adapters")
            == [{"name": "sql", "loadedPods": 0}]
        ),
        what="status.adapters",
    )
    kube.merge(f"{pllm_path(namespace)}/tuned", {"spec": {"adapters": [SQL, POET]}})
    eventually(
        lambda: len(json.loads(kube.get(path)["data"]["adapters.json"])) == 2,
        what="the second adapter in the list",
    )
    kube.delete(path)  # deleted by hand: put back
    eventually(lambda: kube.get(path), what="the ConfigMap again")
