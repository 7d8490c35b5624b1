"""The Grafana dashboard of ``manifests/grafana``: every query parses as PromQL and names only
metrics that a running node or router exports (read from their real ``/metrics``), each with a
sample from the start, and the kustomize base ships it as a ConfigMap Grafana's sidecar picks
up. A fresh node's and router's labelled counters have a zero sample for every fixed label
value, so that a panel shows 0 and an alert on a rate tells "none" from "not scraped"."""

from __future__ import annotations

import json
import re
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.router.metrics import REJECTION_REASONS as ROUTER_REJECTIONS
from pagedllm.router.metrics import UPSTREAM_ERROR_KINDS
from pagedllm.router.policy import Reason
from pagedllm.runtime.metrics import FINISH_REASONS
from pagedllm.runtime.metrics import REJECTION_REASONS as NODE_REJECTIONS
from pagedllm_testing.cluster import binary
from pagedllm_testing.router_harness import ready_backends, wait_for
from pagedllm_testing.serve_harness import DEMO_MODEL, Server

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "manifests" / "grafana" / "pagedllm-dashboard.json"
# Grafana's template query function, which is not PromQL.
LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,")
# AST nodes holding sub-expressions, by attribute; leaves hold none.
CHILDREN = ("args", "expr", "lhs", "rhs", "param", "vector_selector")
LEAVES = {"NumberLiteral", "StringLiteral"}


def dashboard() -> dict[str, Any]:
    value: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return value


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def queries() -> list[str]:
    return [t["expr"] for p in panels(dashboard()["panels"]) for t in p.get("targets", [])]


def metric_names(node: Any) -> set[str]:
    """The metric names an expression's selectors name."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        assert node.name, f"a selector without a metric name: {node}"
        return {node.name}
    names: set[str] = set()
    found = False
    for attribute in CHILDREN:
        child = getattr(node, attribute, None)
        if child is None:
            continue
        found = True
        for item in child if isinstance(child, list) else [child]:
            names |= metric_names(item)
    assert found or kind in LEAVES, f"an expression node this test does not know: {kind}"
    return names


def used_names() -> set[str]:
    names: set[str] = set()
    for expr in queries():
        names |= metric_names(promql_parser.parse(expr))
    for variable in dashboard()["templating"]["list"]:
        query = variable.get("definition") or ""
        names |= set(LABEL_VALUES.findall(query))
    return names


def families(url: str) -> list[Metric]:
    return list(text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text))


def exported(url: str) -> set[str]:
    """Every series name ``url``'s /metrics exports, and the ones its declared families
    would (a labelled counter or histogram nothing has counted yet shows only its family)."""
    names: set[str] = set()
    for family in families(url):
        names |= {s.name for s in family.samples}
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",),
        }.get(family.type, ())
        names |= {family.name + s for s in suffixes}
    return names


def test_every_query_parses_and_the_dashboard_covers_the_issue() -> None:
    exprs = queries()
    assert len(exprs) >= 20
    for expr in exprs:
        promql_parser.parse(expr)  # raises on a query Grafana's Prometheus would refuse
    titles = {p["title"] for p in panels(dashboard()["panels"])}
    for wanted in (
        "Throughput",
        "Time to first token",
        "Inter-token latency",
        "Queue depth",
        "KV usage and waste",
        "Prefix cache hit rate",
        "Preemptions",
        "Routed requests",
    ):
        assert wanted in titles
    text = " ".join(exprs)
    assert "histogram_quantile(0.99" in text and "pagedllm:kv_cache_waste_perc" in text


def test_the_walker_finds_every_selector() -> None:
    expr = 'sum(rate(a_total{x="1"}[5m])) / on() group_left b + -c offset 5m'
    assert metric_names(promql_parser.parse(expr)) == {"a_total", "b", "c"}


def test_the_kustomize_base_ships_the_dashboard_for_grafanas_sidecar() -> None:
    rendered = subprocess.run(
        [binary.kubectl(), "kustomize", str(REPO / "manifests")],
        text=True,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout
    (config_map,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ConfigMap"]
    assert config_map["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert json.loads(config_map["data"]["pagedllm-dashboard.json"]) == dashboard()


# The node (speculating) and the router in front of it are the package's (conftest.py).


def samples(url: str) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
    """Every sample of ``url``'s /metrics: name -> labels -> value."""
    found: dict[str, dict[frozenset[tuple[str, str]], float]] = defaultdict(dict)
    for family in families(url):
        for sample in family.samples:
            found[sample.name][frozenset(sample.labels.items())] = sample.value
    return found


def zero_for_each(
    found: dict[str, dict[frozenset[tuple[str, str]], float]],
    name: str,
    label: str,
    values: list[str],
    **fixed: str,
) -> None:
    for value in values:
        labels = frozenset({**fixed, label: value}.items())
        assert found[name].get(labels) == 0, f"{name}{{{label}={value!r}}}: {found[name]}"


# Runs first in the module, and before any test of the package sends requests through them:
# the node and router have served nothing yet.
def test_a_fresh_node_and_router_export_every_fixed_label_value_at_zero(
    node: Server, router: Server, num_speculative_tokens: int
) -> None:
    wait_for(lambda: ready_backends(router) == 1, router, "the node's feed")
    model = {"model_name": DEMO_MODEL}
    found = samples(node.url)
    zero_for_each(found, "vllm:request_success_total", "finished_reason", FINISH_REASONS, **model)
    zero_for_each(found, "pagedllm:requests_rejected_total", "reason", NODE_REJECTIONS, **model)
    positions = [str(p) for p in range(num_speculative_tokens)]
    zero_for_each(
        found, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position", positions, **model
    )
    assert set(FINISH_REASONS) == {"stop", "length", "abort", "error"}
    found = samples(router.url)
    reasons = [r.value for r in Reason]
    zero_for_each(found, "pagedllm:router_requests_routed_total", "reason", reasons)
    zero_for_each(found, "pagedllm:router_requests_rejected_total", "reason", ROUTER_REJECTIONS)
    zero_for_each(
        found,
        "pagedllm:router_upstream_errors_total",
        "kind",
        UPSTREAM_ERROR_KINDS,
        backend=node.url,
    )


def test_every_metric_the_dashboard_reads_has_a_sample_from_the_start(
    node: Server, router: Server
) -> None:
    wait_for(lambda: ready_backends(router) == 1, router, "the node's feed")
    names = set(samples(node.url)) | set(samples(router.url))
    missing = sorted(used_names() - names)
    assert not missing, f"panels that would show no data on a fresh fleet: {missing}"


def test_every_metric_the_dashboard_reads_is_exported(node: Server, router: Server) -> None:
    wait_for(lambda: ready_backends(router) == 1, router, "the node's feed")
    client = router.client()
    client.completions.create(model=DEMO_MODEL, prompt="Harbour log, day one:", max_tokens=8, n=2)
    stream = client.chat.completions.create(
        model=DEMO_MODEL,
        messages=[{"role": "user", "content": "Name three ports."}],
        max_tokens=8,
        stream=True,
    )
    assert sum(1 for _ in stream) > 1
    refused = httpx.post(  # the grammar does not compile: counted as rejected by the node
        f"{router.url}/v1/completions",
        json={
            "model": DEMO_MODEL,
            "prompt": "Quay:",
            "max_tokens": 1,
            "structured_outputs": {"regex": "(a"},
        },
        timeout=30,
    )
    assert refused.status_code == 400 and "regex" in refused.text, refused.text
    names = exported(node.url) | exported(router.url)
    missing = sorted(used_names() - names)
    assert not missing, f"the dashboard reads metrics nothing exports: {missing}"
