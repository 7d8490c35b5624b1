"""The metrics reference of the documentation (docs/hooks/reference_metrics.py, generated from
the metrics' definitions) names exactly the metric families a live node (speculating, serving
a LoRA adapter) and a router in front of it export: none missing from the reference, none
in it that nothing exports."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm_testing.docs_site import hook
from pagedllm_testing.router_harness import ready_backends, wait_for
from pagedllm_testing.serve_harness import Server


def scraped(server: Server) -> dict[str, str]:
    """family name -> type, as ``server``'s /metrics declares them, less the `NAME_created`
    timestamps prometheus-client adds beside a counter or histogram NAME (the parser of the
    text format reads them as gauges of their own)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    return {
        name: kind
        for name, kind in families.items()
        if not (
            name.endswith("_created")
            and families.get(name.removesuffix("_created")) in ("counter", "histogram")
        )
    }


def referenced(process: str) -> dict[str, str]:
    metrics = hook("reference_metrics").all_metrics()
    return {m.name: m.type for m in metrics if m.process == process}


def test_the_reference_is_what_a_node_and_a_router_export(node: Server, router: Server) -> None:
    # The per-backend gauges have samples once the router follows the node's feed.
    wait_for(lambda: ready_backends(router) == 1, router, "the node's feed")
    node_families, router_families = scraped(node), scraped(router)
    assert "vllm:spec_decode_num_drafts" in node_families  # speculating
    assert "pagedllm:router_backend_kv_usage" in router_families
    assert referenced("node") == node_families
    assert referenced("router") == router_families
