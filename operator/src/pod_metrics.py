"""Reading the serving pods' /metrics (the autoscaler's input; I/O)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.operator.autoscaler import parse_prometheus_value
from pagedllm.operator.children import HTTP_PORT, METRICS_PORT_ANNOTATION

logger = logging.getLogger(__name__)
T = TypeVar("T")


def is_ready(pod: Mapping[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    """http://podIP:port/metrics. The port is the container port named http, unless the pod
    carries the pagedllm.io/metrics-port annotation: tests and the e2e kubelet stand-in run
    pods as local processes on loopback ports and say so there (with 127.0.0.1 as podIP)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    annotations = pod.get("metadata", {}).get("annotations") or {}
    port = annotations.get(METRICS_PORT_ANNOTATION)
    if port is None:
        port = HTTP_PORT
        for container in (pod.get("spec") or {}).get("containers") or []:
            for declared in container.get("ports") or []:
                if declared.get("name") == "http":
                    port = declared["containerPort"]
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


async def _read_one(
    client: httpx.AsyncClient, url: str, metric_name: str, parse: Callable[[str, str], T | None]
) -> T | None:
    try:
        response = await client.get(url)
        response.raise_for_status()
    except httpx.HTTPError as error:
        logger.info("metrics of %s unavailable: %s", url, error)
        return None
    try:
        value = parse(response.text, metric_name)
    except ValueError as error:
        logger.info("%s is not Prometheus text: %s", url, error)
        return None
    if value is None:
        logger.info("%s does not export %s", url, metric_name)
    return value


async def _read_ready(
    pods: Sequence[Mapping[str, Any]],
    metric_name: str,
    timeout: float,
    parse: Callable[[str, str], T | None],
) -> list[T]:
    urls = [url for pod in pods if is_ready(pod) and (url := metrics_url(pod)) is not None]
    if not urls:
        return []
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        values = await asyncio.gather(*(_read_one(client, url, metric_name, parse) for url in urls))
    return [value for value in values if value is not None]


async def read_ready_pods(
    pods: Sequence[Mapping[str, Any]], metric_name: str, timeout: float
) -> list[float]:
    """The metric of every ready pod that answered in time."""
    return await _read_ready(pods, metric_name, timeout, parse_prometheus_value)


# The node's gauge: 1 for each adapter it serves, 0 for one it no longer serves.
ADAPTER_SERVED_METRIC = "pagedllm:lora_adapter_served"


def served_adapters(text: str, metric_name: str = ADAPTER_SERVED_METRIC) -> frozenset[str] | None:
    """The adapters a node's /metrics says it serves (None when it has no such gauge: a node
    without LoRA, or of a version before it). Raises ValueError for text that is not in the
    exposition format."""
    found = False
    served = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric_name:
                found = True
                if sample.value == 1 and sample.labels.get("adapter"):
                    served.add(sample.labels["adapter"])
    return frozenset(served) if found else None


async def read_served_adapters(
    pods: Sequence[Mapping[str, Any]], timeout: float
) -> list[frozenset[str]]:
    """The adapters each ready pod that answered in time serves (from /metrics, which needs
    no API key: the operator never holds one)."""
    return await _read_ready(pods, ADAPTER_SERVED_METRIC, timeout, served_adapters)


# The routers' gauge of requests waiting for a ready serving pod (scale from zero).
HELD_REQUESTS_METRIC = "pagedllm:router_held_requests"


async def read_held_requests(router_pods: Sequence[Mapping[str, Any]], timeout: float) -> float:
    """Requests the ready routers hold, all together (a router that does not answer counts
    none: its held requests show again at the next look)."""
    return sum(await read_ready_pods(router_pods, HELD_REQUESTS_METRIC, timeout))
