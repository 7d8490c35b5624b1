"""Reading the serving pods' /metrics (the autoscaler's input; I/O)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from pagedllm.operator.autoscaler import parse_prometheus_value
from pagedllm.operator.children import HTTP_PORT, METRICS_PORT_ANNOTATION

logger = logging.getLogger(__name__)


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


async def _read_one(client: httpx.AsyncClient, url: str, metric_name: str) -> float | None:
    try:
        response = await client.get(url)
        response.raise_for_status()
    except httpx.HTTPError as error:
        logger.info("metrics of %s unavailable: %s", url, error)
        return None
    try:
        value = parse_prometheus_value(response.text, metric_name)
    except ValueError as error:
        logger.info("%s is not Prometheus text: %s", url, error)
        return None
    if value is None:
        logger.info("%s does not export %s", url, metric_name)
    return value


async def read_ready_pods(
    pods: Sequence[Mapping[str, Any]], metric_name: str, timeout: float
) -> list[float]:
    """The metric of every ready pod that answered in time."""
    urls = [url for pod in pods if is_ready(pod) and (url := metrics_url(pod)) is not None]
    if not urls:
        return []
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        values = await asyncio.gather(*(_read_one(client, url, metric_name) for url in urls))
    return [value for value in values if value is not None]


# The routers' gauge of requests waiting for a ready serving pod (scale from zero).
HELD_REQUESTS_METRIC = "pagedllm:router_held_requests"


async def read_held_requests(router_pods: Sequence[Mapping[str, Any]], timeout: float) -> float:
    """Requests the ready routers hold, all together (a router that does not answer counts
    none: its held requests show again at the next look)."""
    return sum(await read_ready_pods(router_pods, HELD_REQUESTS_METRIC, timeout))
