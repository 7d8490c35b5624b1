"""One level-based reconcile of a PagedLLM, and one autoscaler step (the I/O around the pure
builders, status and autoscaler)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.operator.autoscaler import AutoscalerState, decide
from pagedllm.operator.children import (
    Owner,
    build_children,
    router_name,
    router_selector_labels,
    selector_labels,
    selector_string,
    selects_routers,
    service_url,
)
from pagedllm.operator.config import OperatorConfig
from pagedllm.operator.drift import first_difference, stamped
from pagedllm.operator.kube import ApiError, KubeClient, now_rfc3339
from pagedllm.operator.live import FreshReads, Live, Snapshot
from pagedllm.operator.pod_metrics import (
    is_ready,
    read_held_requests,
    read_ready_pods,
    read_served_adapters,
)
from pagedllm.operator.spec import (
    API_VERSION,
    KIND,
    AutoscalingMode,
    InvalidSpec,
    ModelSourceKind,
    PagedLLMSpec,
    effective_replicas,
    parse_spec,
)
from pagedllm.operator.status import (
    DEGRADED,
    Observed,
    RouterObserved,
    compute_status,
    newly_true,
)

logger = logging.getLogger(__name__)

SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"


@dataclass
class OperatorContext:
    """Operator-wide state, shared by every handler through kopf's memo."""

    config: OperatorConfig
    kube: KubeClient
    # One reconcile at a time per PagedLLM (change handlers, the resync timer, child events).
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    autoscalers: dict[str, AutoscalerState] = field(default_factory=dict)
    # uid -> (namespace, name) of every PagedLLM served, for the resync timer.
    tracked: dict[str, tuple[str, str]] = field(default_factory=dict)
    # uid -> the latest body the watch delivered: what a resync checks before reading anew.
    seen: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    # PagedLLMs whose spec cannot be served: kopf retries them with backoff, resync skips.
    backing_off: set[str] = field(default_factory=set)
    # (when looked up, whether the ServiceMonitor CRD exists)
    _service_monitors: tuple[float, bool] | None = field(default=None, init=False)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, uid: str) -> None:
        where = self.tracked.pop(uid, None)
        if where is not None:
            self.locks.pop(where, None)
        self.seen.pop(uid, None)
        self.autoscalers.pop(uid, None)
        self.backing_off.discard(uid)

    async def service_monitors_available(self) -> bool:
        now = time.monotonic()
        if (
            self._service_monitors is None
            or now - self._service_monitors[0] > self.config.discovery_cache_seconds
        ):
            crd = await self.kube.get(
                "apiextensions.k8s.io/v1", "CustomResourceDefinition", SERVICE_MONITOR_CRD
            )
            self._service_monitors = (now, crd is not None)
        return self._service_monitors[1]


async def _check_references(kube: KubeClient, owner: Owner, spec: PagedLLMSpec) -> None:
    """What the schema cannot know: the claims of the model and the adapters must exist."""
    claims = {}
    if spec.model.source.kind is ModelSourceKind.PVC:
        claims[spec.model.source.claim] = "spec.model.uri"
    for adapter in spec.adapters:
        if adapter.source.kind is ModelSourceKind.PVC:
            claims.setdefault(adapter.source.claim, f"the uri of adapter {adapter.name!r}")
    for claim, where in claims.items():
        if await kube.get("v1", "PersistentVolumeClaim", claim, owner.namespace) is None:
            raise InvalidSpec(
                f'PersistentVolumeClaim "{claim}" (from {where}) does not '
                f'exist in namespace "{owner.namespace}"'
            )
    # A missing API-key Secret is not looked up here (that would need read access to every
    # Secret); the pod reports it as CreateContainerConfigError, which shows as Degraded.


def _owned_by(obj: Mapping[str, Any], owner: Owner) -> bool:
    return any(
        ref.get("uid") == owner.uid for ref in obj.get("metadata", {}).get("ownerReferences") or []
    )


class _WriteNeeded(Exception):
    """A quiet pass found something to write; the reconcile is redone on fresh reads."""


async def _routers_in_front(live: Live, owner: Owner, spec: PagedLLMSpec) -> bool:
    """Whether the Service may select the routers: once one of them is ready, and from then
    on. Switching earlier would leave clients without an endpoint while the routers start,
    e.g. when an operator upgrade puts routers in front of a PagedLLM that already serves."""
    if not spec.router.enabled:
        return False
    service = await live.get("v1", "Service", owner.name)
    if selects_routers(service, owner.name):
        return True
    routers = await live.get("apps/v1", "Deployment", router_name(owner.name))
    return ((routers or {}).get("status") or {}).get("readyReplicas", 0) > 0


async def _apply(
    ctx: OperatorContext,
    owner: Owner,
    wanted: Mapping[str, Any],
    existing: Mapping[str, Any] | None,
) -> None:
    """Server-side apply of a child; where that cannot make it what the operator wants, the
    rest put back with a JSON merge patch.

    Apply owns only what the operator sets: entries another manager added to a keyed list (a
    Service port or a container's env var edited by hand: ports are keyed by port and
    protocol, env vars by name) stay beside the operator's. The merged object is then either
    invalid (two ports named "http": 422, nothing written) or still not the manifest. The
    top-level field that differs (such as spec) is then merge-patched: each list in it becomes
    the operator's whole list, and what the API server and others set elsewhere stays."""
    try:
        applied: Mapping[str, Any] = await ctx.kube.apply(wanted)
    except ApiError as error:
        if existing is None or error.status != 422:
            raise
        applied = existing
    remaining = first_difference(wanted, applied)
    field_name = (remaining or "").strip("/").split("/")[0]
    if field_name not in wanted:
        return
    metadata = wanted["metadata"]
    logger.info(
        "%s/%s: %s %s differs at %s after apply; merge-patching its %s",
        owner.namespace,
        owner.name,
        wanted["kind"],
        metadata["name"],
        remaining,
        field_name,
    )
    await ctx.kube.merge_patch(
        wanted["apiVersion"],
        wanted["kind"],
        metadata["name"],
        owner.namespace,
        {field_name: wanted[field_name]},
    )


async def _apply_children(
    ctx: OperatorContext,
    owner: Owner,
    spec: PagedLLMSpec,
    replicas: int,
    live: Live,
    quiet: bool,
) -> None:
    """Apply each child that differs from what is live, delete each one no longer wanted;
    a child already as wanted is left alone (no request at all)."""
    children = build_children(
        owner,
        spec,
        replicas,
        await ctx.service_monitors_available(),
        routers_in_front=await _routers_in_front(live, owner, spec),
    )
    for manifest in children.wanted:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        existing = await live.get(manifest["apiVersion"], kind, name)
        if existing is not None and not _owned_by(existing, owner):
            raise InvalidSpec(
                f'{kind} "{name}" already exists and belongs '
                "to something else; rename the PagedLLM or remove it"
            )
        wanted = stamped(manifest)
        difference = first_difference(wanted, existing)
        if difference is None:
            continue
        if quiet:
            raise _WriteNeeded
        if existing is None:
            logger.debug("%s/%s: creating %s %s", owner.namespace, owner.name, kind, name)
        else:
            logger.info(
                "%s/%s: updating %s %s (%s differs)",
                owner.namespace,
                owner.name,
                kind,
                name,
                difference,
            )
        await _apply(ctx, owner, wanted, existing)
    for ref in children.unwanted:
        existing = await live.get(ref.api_version, ref.kind, ref.name)
        if existing is not None and _owned_by(existing, owner):
            if quiet:
                raise _WriteNeeded
            await ctx.kube.delete(ref.api_version, ref.kind, ref.name, owner.namespace)


async def _observe(
    live: Live, owner: Owner, spec: PagedLLMSpec, metrics_timeout: float
) -> Observed:
    deployment = await live.get("apps/v1", "Deployment", owner.name)
    pods = await live.pods(selector_labels(owner.name))
    served = await read_served_adapters(pods, metrics_timeout) if spec.adapters else []
    observed = Observed(deployment=deployment, pods=pods, served_adapters=served)
    if not spec.router.enabled:
        return observed
    router = RouterObserved(
        wanted=spec.router.replicas,
        deployment=await live.get("apps/v1", "Deployment", router_name(owner.name)),
        pods=await live.pods(router_selector_labels(owner.name)),
    )
    return dataclasses.replace(observed, router=router)


async def _write_status(
    ctx: OperatorContext, body: Mapping[str, Any], status: dict[str, Any], quiet: bool = False
) -> None:
    previous = body.get("status") or {}
    if all(previous.get(key) == value for key, value in status.items()):
        return
    if quiet:
        raise _WriteNeeded
    metadata = body["metadata"]
    await ctx.kube.merge_patch(
        API_VERSION,
        KIND,
        metadata["name"],
        metadata["namespace"],
        {"status": status},
        subresource="status",
    )
    became_degraded = newly_true(previous.get("conditions") or [], status["conditions"], DEGRADED)
    if became_degraded is not None:
        await ctx.kube.post_event(
            body,
            type="Warning",
            reason=became_degraded["reason"],
            message=became_degraded["message"],
        )


@dataclass(frozen=True)
class Seen:
    """What a resync already holds about a PagedLLM: its body as the watch last delivered it
    and its namespace's snapshot."""

    body: Mapping[str, Any]
    snapshot: Snapshot


async def _is_quiet(ctx: OperatorContext, seen: Seen) -> bool:
    """Whether reconciling on what was seen would write nothing. Stale knowledge is safe
    here: it can only make a write look needed (then the reconcile reads anew), or miss a
    change whose own event reconciles it anyway."""
    if seen.body["metadata"].get("deletionTimestamp"):
        return True
    try:
        await _reconcile(ctx, seen.body, seen.snapshot, quiet=True)
    except (_WriteNeeded, InvalidSpec):
        return False
    return True


def _operator_autoscaled(body: Mapping[str, Any]) -> bool:
    scaling = parse_spec(body.get("spec") or {}).autoscaling
    return scaling is not None and scaling.mode is AutoscalingMode.OPERATOR


async def reconcile(
    ctx: OperatorContext,
    namespace: str,
    name: str,
    *,
    autoscaling: bool = False,
    seen: Seen | None = None,
) -> None:
    """Make the children match the spec and the status match the children; with
    `autoscaling`, then take one autoscaler step.

    One at a time per PagedLLM, each write on a fresh read: a reconcile that waited for
    another must not act on what that one has just changed (e.g. apply replicas from before
    /scale). With `seen` (the resync), what was seen is checked first, and when it needs no
    write, nothing is read at all (the autoscaler still reads the PagedLLM and its pods).
    Raises InvalidSpec (after recording it in status) for a spec that cannot be served."""
    async with ctx.lock(namespace, name):
        if seen is not None and await _is_quiet(ctx, seen):
            if autoscaling and _operator_autoscaled(seen.body):
                body = await ctx.kube.get(API_VERSION, KIND, name, namespace)
                if body is not None and not body["metadata"].get("deletionTimestamp"):
                    await _autoscale(ctx, body, seen.snapshot)
            return
        body = await ctx.kube.get(API_VERSION, KIND, name, namespace)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        live = FreshReads(ctx.kube, namespace)
        await _reconcile(ctx, body, live)
        if autoscaling:
            await _autoscale(ctx, body, live)


async def _reconcile(
    ctx: OperatorContext, body: Mapping[str, Any], live: Live, *, quiet: bool = False
) -> None:
    """With `quiet`, raise _WriteNeeded instead of writing anything."""
    owner = Owner.from_body(body)
    generation = body["metadata"].get("generation", 1)
    try:
        spec = parse_spec(body.get("spec") or {})
        await _check_references(ctx.kube, owner, spec)
        replicas = effective_replicas(spec)
        await _apply_children(ctx, owner, spec, replicas, live, quiet)
    except (InvalidSpec, ApiError) as error:
        # A write RBAC forbids is recorded like a spec that cannot be served (Degraded, a
        # Warning Event), so a ClusterRole missing a verb is seen, not a silent stall.
        forbidden = isinstance(error, ApiError) and error.status == 403
        if quiet or not (isinstance(error, InvalidSpec) or forbidden):
            raise
        status = compute_status(
            generation=generation,
            desired=0,
            url="",
            selector=selector_string(owner.name),
            observed=Observed(None, []),
            previous=body.get("status") or {},
            now=now_rfc3339(),
            spec_error=str(error),
            error_reason="Forbidden" if forbidden else "InvalidSpec",
        )
        await _write_status(ctx, body, status)
        raise
    observed = await _observe(live, owner, spec, ctx.config.metrics_timeout_seconds)
    status = compute_status(
        generation=generation,
        desired=replicas,
        url=service_url(owner, spec),
        selector=selector_string(owner.name),
        observed=observed,
        previous=body.get("status") or {},
        now=now_rfc3339(),
        adapters=[adapter.name for adapter in spec.adapters],
    )
    await _write_status(ctx, body, status, quiet)


async def _autoscale(ctx: OperatorContext, body: Mapping[str, Any], live: Live) -> None:
    """One step of the built-in autoscaler: read the pods' load, maybe write /scale."""
    spec = parse_spec(body.get("spec") or {})
    scaling = spec.autoscaling
    owner = Owner.from_body(body)
    if scaling is None or scaling.mode is not AutoscalingMode.OPERATOR:
        ctx.autoscalers.pop(owner.uid, None)
        return
    current = effective_replicas(spec)
    pods = await live.pods(selector_labels(owner.name))
    per_pod = await read_ready_pods(
        pods, scaling.metric.prometheus_name, ctx.config.metrics_timeout_seconds
    )
    ready = sum(1 for pod in pods if is_ready(pod))
    held = 0.0
    if spec.router.enabled:
        routers = await live.pods(router_selector_labels(owner.name))
        held = await read_held_requests(routers, ctx.config.metrics_timeout_seconds)
    decision, state = decide(
        ctx.autoscalers.get(owner.uid, AutoscalerState()),
        current=current,
        ready=ready,
        per_pod=per_pod,
        scaling=scaling,
        now=time.monotonic(),
        held=held,
    )
    ctx.autoscalers[owner.uid] = state
    if decision.replicas == spec.replicas:
        return
    # Everyone scales through /scale: the Deployment follows spec.replicas on the next reconcile.
    await ctx.kube.merge_patch(
        API_VERSION,
        KIND,
        owner.name,
        owner.namespace,
        {"spec": {"replicas": decision.replicas}},
        subresource="scale",
    )
    if not decision.changes(current):
        return  # spec.replicas was only unset or out of bounds; the replicas do not move
    await ctx.kube.merge_patch(
        API_VERSION,
        KIND,
        owner.name,
        owner.namespace,
        {"status": {"desiredReplicas": decision.replicas, "lastScaleTime": now_rfc3339()}},
        subresource="status",
    )
    direction = "ScaledUp" if decision.replicas > current else "ScaledDown"
    message = f"{current} -> {decision.replicas} replicas: {decision.explanation}"
    logger.info("%s/%s %s", owner.namespace, owner.name, message)
    await ctx.kube.post_event(body, type="Normal", reason=direction, message=message)
