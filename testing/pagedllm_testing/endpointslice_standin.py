"""A stand-in for the EndpointSlice controller (test infrastructure): publishes the
EndpointSlices of each Service with a selector in one namespace, as kube-controller-manager
does, for what reads them (the router's discovery).

Endpoints are the pods the selector matches, not yet finished: `ready` is the pod's Ready
condition and false while terminating, `serving` is readiness regardless of termination,
`terminating` is the deletion mark (the controller's own rules). Ports are resolved per pod;
the real controller puts pods whose named target ports resolve to different numbers into
different slices, and here every pod's ports differ (each gets its own loopback ports from the
kubelet stand-in, see service_proxy.endpoint_port), so every pod gets a slice of its own.
Slices are owned by their Service (the garbage collector removes them with it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedllm.router.discovery import SERVICE_NAME_LABEL
from pagedllm_testing.deployment_standin import is_terminating
from pagedllm_testing.service_proxy import LOOPBACK, endpoint_port, selects

MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "endpointslice-controller.k8s.io"
API_VERSION = "discovery.k8s.io/v1"


def _condition(pod: Mapping[str, Any], kind: str) -> bool:
    return any(
        c.get("type") == kind and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _finished(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def build_slices(
    service: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The slices the controller would publish for `service` (pure)."""
    selector = service["spec"].get("selector") or {}
    metadata = service["metadata"]
    slices = []
    for pod in pods:
        if not selects(selector, pod) or _finished(pod):
            continue
        ports = []
        for service_port in service["spec"].get("ports") or []:
            port = endpoint_port(pod, service_port.get("targetPort", service_port["port"]))
            if port is not None:
                ports.append(
                    {
                        "name": service_port.get("name") or "",
                        "port": port,
                        "protocol": service_port.get("protocol", "TCP"),
                    }
                )
        if not ports:
            continue  # not started yet: the kubelet stand-in has not given it ports
        ready = _condition(pod, "Ready")
        terminating = is_terminating(pod)
        slices.append(
            {
                "apiVersion": API_VERSION,
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{metadata['name']}-{pod['metadata']['uid'][:8]}",
                    "namespace": metadata["namespace"],
                    "labels": {SERVICE_NAME_LABEL: metadata["name"], MANAGED_BY_LABEL: MANAGED_BY},
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Service",
                            "name": metadata["name"],
                            "uid": metadata["uid"],
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "addressType": "IPv4",
                "ports": ports,
                "endpoints": [
                    {
                        "addresses": [(pod.get("status") or {}).get("podIP") or LOOPBACK],
                        "conditions": {
                            "ready": ready and not terminating,
                            "serving": ready,
                            "terminating": terminating,
                        },
                        "targetRef": {
                            "kind": "Pod",
                            "name": pod["metadata"]["name"],
                            "namespace": pod["metadata"]["namespace"],
                            "uid": pod["metadata"]["uid"],
                        },
                    }
                ],
            }
        )
    return slices


def _content(obj: Mapping[str, Any]) -> tuple[Any, ...]:
    return (obj.get("ports"), obj.get("endpoints"), obj["metadata"].get("labels"))


class EndpointSliceStandin:
    """Keeps the namespace's controller-managed EndpointSlices equal to build_slices."""

    def __init__(self, kube: Any, namespace: str):
        self.kube = kube
        self.namespace = namespace

    async def sync(self) -> None:
        services = await self.kube.list("v1", "Service", self.namespace)
        pods = await self.kube.list("v1", "Pod", self.namespace)
        existing = {
            s["metadata"]["name"]: s
            for s in await self.kube.list(
                API_VERSION, "EndpointSlice", self.namespace, f"{MANAGED_BY_LABEL}={MANAGED_BY}"
            )
        }
        wanted = {
            s["metadata"]["name"]: s
            for service in services
            if (service["spec"].get("selector") or {}) and not is_terminating(service)
            for s in build_slices(service, pods)
        }
        for name, endpoint_slice in wanted.items():
            if name not in existing:
                await self.kube.create(endpoint_slice)
            elif _content(existing[name]) != _content(endpoint_slice):
                await self.kube.apply(endpoint_slice)
        for name in existing.keys() - wanted.keys():
            await self.kube.delete(API_VERSION, "EndpointSlice", name, self.namespace)
