"""kopf's entry points: settings, login, and the handlers that call reconcile/autoscale."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

import kopf

from pagedllm.operator.children import LABEL_MANAGED_BY, OPERATOR_NAME
from pagedllm.operator.config import OperatorConfig
from pagedllm.operator.kube import KubeClient, KubeError
from pagedllm.operator.live import Snapshot, read_snapshot
from pagedllm.operator.reconcile import OperatorContext, Seen, reconcile
from pagedllm.operator.spec import GROUP, KIND, PLURAL, VERSION, InvalidSpec

DOMAIN = GROUP  # kopf's annotations and finalizer live under our own domain
MANAGED = {LABEL_MANAGED_BY: OPERATOR_NAME}

logger = logging.getLogger(__name__)


def _login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings
    )


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = OperatorConfig.from_env()
    settings.persistence.finalizer = f"{DOMAIN}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=DOMAIN)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=DOMAIN, key="last-handled-configuration"
    )
    # kopf's per-handler messages stay in the log; the operator posts its own Events.
    settings.posting.enabled = False
    # One replica (Recreate) by design: no peering objects needed.
    settings.peering.standalone = True
    # Every /metrics read at INFO would drown the operator's own log lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # The apiserver reads timeoutSeconds as whole seconds: "300.0" is a 400 Bad Request.
    settings.watching.server_timeout = max(1, math.ceil(config.watch_timeout_seconds))
    settings.watching.client_timeout = config.watch_timeout_seconds + 30
    settings.execution.default_backoff = config.backoff_seconds
    memo.ctx = OperatorContext(config=config, kube=KubeClient(lambda: _login(settings)))


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, **_: Any) -> None:
    memo.resync_task = asyncio.create_task(_resync_forever(memo.ctx), name="pagedllm-resync")


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
    return _login(settings)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    memo.resync_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await memo.resync_task
    await memo.ctx.kube.close()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_pagedllm(meta: kopf.Meta, retry: int, memo: kopf.Memo, **_: Any) -> None:
    ctx: OperatorContext = memo.ctx
    try:
        await reconcile(ctx, meta["namespace"], meta["name"])
    except InvalidSpec as error:
        # Status and a Warning Event already say what is wrong; kopf retries with backoff.
        ctx.backing_off.add(meta["uid"])
        delay = ctx.config.backoff(retry)
        raise kopf.TemporaryError(f"{error} (retrying in {delay:g}s)", delay=delay) from error
    ctx.backing_off.discard(meta["uid"])


@kopf.on.event(GROUP, VERSION, PLURAL)
def track(event: kopf.RawEvent, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """Remember which PagedLLMs this operator serves (kopf's namespace scope applies), for
    the resync timer. An event handler needs no finalizer, unlike kopf's own timers and
    daemons: deleting a PagedLLM never waits for the operator."""
    ctx: OperatorContext = memo.ctx
    if event.get("type") == "DELETED":
        ctx.forget(meta["uid"])
    else:
        ctx.tracked[meta["uid"]] = (meta["namespace"], meta["name"])
        ctx.seen[meta["uid"]] = event["object"]


async def _resync_one(
    ctx: OperatorContext, uid: str, namespace: str, name: str, snapshot: Snapshot | None
) -> None:
    if uid in ctx.backing_off:
        return  # the change handler is retrying it with backoff
    body = ctx.seen.get(uid)
    seen = None if snapshot is None or body is None else Seen(body, snapshot)
    try:
        await reconcile(ctx, namespace, name, autoscaling=True, seen=seen)
    except InvalidSpec:
        pass  # recorded in status and an Event
    except KubeError as error:
        logger.warning(
            "resync of %s/%s failed, next try in %gs: %s",
            namespace,
            name,
            ctx.config.resync_seconds,
            error,
        )
    except Exception:
        # One resource's surprise must not stop the timer for all the others.
        logger.exception("resync of %s/%s failed", namespace, name)


async def _snapshots(ctx: OperatorContext, namespaces: list[str]) -> dict[str, Snapshot]:
    """One list per child kind (and of pods) per namespace; a namespace whose lists fail is
    reconciled on reads of its own objects instead."""
    snapshots: dict[str, Snapshot] = {}
    try:
        monitors = await ctx.service_monitors_available()
    except KubeError as error:
        logger.warning("resync reads objects one by one: %s", error)
        return snapshots
    for namespace, listed in zip(
        namespaces,
        await asyncio.gather(
            *(read_snapshot(ctx.kube, namespace, monitors) for namespace in namespaces),
            return_exceptions=True,
        ),
        strict=True,
    ):
        if isinstance(listed, Snapshot):
            snapshots[namespace] = listed
        elif isinstance(listed, Exception):  # e.g. RBAC without list on a child kind
            logger.warning("resync reads %s one object at a time: %s", namespace, listed)
        else:
            raise listed
    return snapshots


async def resync(ctx: OperatorContext) -> None:
    """Reconcile and autoscale each served PagedLLM, checking first against the PagedLLM as
    watched and a snapshot of its namespace: at steady state that is the only read, and
    nothing is written."""
    started = time.monotonic()
    tracked = list(ctx.tracked.items())
    snapshots = await _snapshots(ctx, sorted({namespace for _, (namespace, _) in tracked}))
    await asyncio.gather(
        *(
            _resync_one(ctx, uid, namespace, name, snapshots.get(namespace))
            for uid, (namespace, name) in tracked
        )
    )
    logger.debug(
        "resync of %d PagedLLMs in %d namespaces took %.2fs",
        len(tracked),
        len(snapshots),
        time.monotonic() - started,
    )


async def _resync_forever(ctx: OperatorContext) -> None:
    """The timer: every resync period, reconcile and autoscale each served PagedLLM (the
    level-based safety net: children deleted or changed by hand, pods' state, the load)."""
    while True:
        await asyncio.sleep(ctx.config.resync_seconds)
        await resync(ctx)


def _owner_name(meta: kopf.Meta) -> str | None:
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            return ref.get("name")
    return None


async def _reconcile_owner(
    event: kopf.RawEvent, meta: kopf.Meta, memo: kopf.Memo, logger: kopf.Logger
) -> None:
    """A child changed or vanished: reconcile its PagedLLM now instead of at the next resync."""
    ctx: OperatorContext = memo.ctx
    owner_name = _owner_name(meta)
    if owner_name is None or event.get("type") is None:
        return  # not ours, or the initial listing (the resume handlers cover that)
    try:
        await reconcile(ctx, meta["namespace"], owner_name)
    except InvalidSpec:
        pass  # recorded in status and an Event
    except KubeError as error:
        logger.warning("reconcile of %s after a child event failed: %s", owner_name, error)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def deployment_changed(
    event: kopf.RawEvent, meta: kopf.Meta, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    await _reconcile_owner(event, meta, memo, logger)


@kopf.on.event("v1", "services", labels=MANAGED)
async def service_changed(
    event: kopf.RawEvent, meta: kopf.Meta, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    if event.get("type") == "DELETED":
        await _reconcile_owner(event, meta, memo, logger)


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
async def disruption_budget_changed(
    event: kopf.RawEvent, meta: kopf.Meta, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    if event.get("type") == "DELETED":
        await _reconcile_owner(event, meta, memo, logger)


@kopf.on.event("v1", "configmaps", labels=MANAGED)
async def adapters_changed(
    event: kopf.RawEvent, meta: kopf.Meta, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """The adapters' list deleted or edited by hand: put it back before pods drop them."""
    if event.get("type") in ("DELETED", "MODIFIED"):
        await _reconcile_owner(event, meta, memo, logger)
