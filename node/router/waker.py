"""Scale from zero: while the router holds requests and no serving pod is ready, ask for
capacity by writing the PagedLLM's `/scale` subresource, the same one the autoscaler, an HPA,
`kubectl scale` and GitOps tools write.

Only a PagedLLM at zero is touched: the write carries the resourceVersion of the `/scale` it
read, so it fails (409) rather than overwrite what someone else wrote meanwhile, and routers
that all wake the same PagedLLM write the same value. While requests stay held the router looks
again every few seconds (a write that failed, or a scale-down that raced with the first
request, is retried); the operator's autoscaler counts held requests as load, so it does not
scale down while any are held.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes.client
import urllib3
from kubernetes.client.exceptions import ApiException

logger = logging.getLogger(__name__)

GROUP = "pagedllm.io"
VERSION = "v1alpha1"
PLURAL = "pagedllms"
# How often a router holding requests checks that capacity is coming.
RECHECK_SECONDS = 5.0
CONFLICT = 409


@dataclass(frozen=True)
class ScaleTarget:
    """The PagedLLM to wake, and the replicas it gets (max(minReplicas, 1))."""

    namespace: str
    name: str
    replicas: int = 1


def wake_patch(scale: Mapping[str, Any], replicas: int) -> dict[str, Any] | None:
    """The merge patch that raises a `/scale` at zero to ``replicas``, guarded by the
    resourceVersion that was read; None when it is not at zero (capacity is already asked for,
    or coming)."""
    current = (scale.get("spec") or {}).get("replicas") or 0
    if current != 0:
        return None
    version = (scale.get("metadata") or {}).get("resourceVersion")
    patch: dict[str, Any] = {"spec": {"replicas": replicas}}
    if version:
        patch["metadata"] = {"resourceVersion": version}
    return patch


class Waker:
    """Follows the router's held requests; ``held`` says how many there are now, ``ready``
    whether a backend is ready. ``poke`` is called when a request starts to wait."""

    def __init__(
        self,
        target: ScaleTarget,
        api_client: kubernetes.client.ApiClient,
        held: Callable[[], int],
        ready: Callable[[], bool],
        recheck_seconds: float = RECHECK_SECONDS,
    ) -> None:
        self.target = target
        self.api = kubernetes.client.CustomObjectsApi(api_client)
        self.held = held
        self.ready = ready
        self.recheck_seconds = recheck_seconds
        self._poked = asyncio.Event()

    def poke(self) -> None:
        self._poked.set()

    async def run(self) -> None:
        while True:
            await self._poked.wait()
            self._poked.clear()
            while self.held() > 0 and not self.ready():
                # The kubernetes package is synchronous: off the event loop.
                await asyncio.to_thread(self.wake_once)
                try:
                    await asyncio.wait_for(self._poked.wait(), self.recheck_seconds)
                    self._poked.clear()
                except asyncio.TimeoutError:
                    pass

    def wake_once(self) -> bool:
        """One look at `/scale`, and one write if it is at zero; whether it wrote. Errors are
        logged, never raised: the held requests keep waiting and the next look retries."""
        t = self.target
        try:
            scale: Any = self.api.get_namespaced_custom_object_scale(
                GROUP, VERSION, t.namespace, PLURAL, t.name, _request_timeout=10
            )
            patch = wake_patch(scale, t.replicas)
            if patch is None:
                return False
            self.api.patch_namespaced_custom_object_scale(
                GROUP,
                VERSION,
                t.namespace,
                PLURAL,
                t.name,
                patch,
                _content_type="application/merge-patch+json",
                _request_timeout=10,
            )
        except ApiException as error:
            if error.status == CONFLICT:
                logger.info("the scale of %s/%s changed while waking it", t.namespace, t.name)
            else:
                logger.warning(
                    "cannot wake %s/%s: %s %s", t.namespace, t.name, error.status, error.reason
                )
            return False
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as error:
            logger.warning("cannot wake %s/%s: %s", t.namespace, t.name, error)
            return False
        logger.info(
            "%s/%s was at zero replicas with requests held: scaled to %d",
            t.namespace,
            t.name,
            t.replicas,
        )
        return True
