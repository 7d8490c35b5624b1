"""The REST face of the store: aiohttp routes every request to discovery, OpenAPI, or the
verbs on a resource (list, watch, get, create, replace, patch, delete, /status, /scale)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from aiohttp import web

from pagedllm_testing.emulator import discovery, openapi, openapi_v2_proto, pod_actions
from pagedllm_testing.emulator.errors import ApiError, bad_request, invalid, no_such_resource
from pagedllm_testing.emulator.objects import set_path
from pagedllm_testing.emulator.patches import (
    JsonPatchTestFailed,
    deep_merge,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from pagedllm_testing.emulator.requests import REQUESTS_PATH, RecordedRequest, RequestLog, summary
from pagedllm_testing.emulator.resources import (
    BINDING_SUBRESOURCE,
    BUILTIN_TYPES,
    EVICTION_SUBRESOURCE,
    SCALE_SUBRESOURCE,
    ResourceType,
)
from pagedllm_testing.emulator.routing import ResourceRequest, parse_resource_path
from pagedllm_testing.emulator.selectors import (
    Selection,
    parse_field_selector,
    parse_label_selector,
)
from pagedllm_testing.emulator.store import KubeEmulator
from pagedllm_testing.emulator.tables import table, wants_table
from pagedllm_testing.emulator.watches import WatchOptions, WatchStream, truthy

HEALTH_PATHS = ("/healthz", "/livez", "/readyz")
APPLY_PATCH = "application/apply-patch+yaml"
BUILTIN_GROUPS = frozenset(t.group for t in BUILTIN_TYPES)

Change = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class WriteOptions:
    strict: bool  # fieldValidation=Strict: unknown fields are an error
    dry_run: bool

    @classmethod
    def from_query(cls, query: Any) -> WriteOptions:
        return cls(query.get("fieldValidation") == "Strict", query.get("dryRun") == "All")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data), status=status, content_type="application/json")


def _table_of(
    request: web.Request, em: KubeEmulator, rtype: ResourceType, items: list[dict[str, Any]]
) -> dict[str, Any]:
    include_object = request.query.get("includeObject", "PartialObjectMetadata")
    return table(rtype, items, include_object, em.revision)


def _selection(query: Any, namespace: str | None) -> Selection:
    return Selection(
        namespace,
        parse_label_selector(query.get("labelSelector", "")),
        parse_field_selector(query.get("fieldSelector", "")),
    )


def _list_of(em: KubeEmulator, rtype: ResourceType, items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "kind": f"{rtype.kind}List",
        "apiVersion": rtype.api_version,
        "metadata": {"resourceVersion": str(em.revision)},
        "items": items,
    }


async def _body(request: web.Request) -> dict[str, Any]:
    text = await request.text()
    if "yaml" in request.headers.get("Content-Type", ""):
        return yaml.safe_load(text) or {}
    return json.loads(text or "{}")


class EmulatorServer:
    """The REST face of a KubeEmulator."""

    def __init__(
        self, emulator: KubeEmulator | None = None, *, bookmark_interval: float = 30.0
    ) -> None:
        self.emulator = emulator or KubeEmulator()
        self.bookmark_interval = bookmark_interval
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.requests = RequestLog()
        self._stopping = asyncio.Event()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.runner = web.AppRunner(self.app, handle_signals=False, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        sockets = site._server.sockets  # type: ignore[union-attr]
        self.url = f"http://{host}:{sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        self._stopping.set()
        for watcher in self.emulator.watchers:
            watcher.queue.put_nowait(None)  # end open watches now, not at their next timeout
        if self.runner is not None:
            await self.runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        if path != REQUESTS_PATH:  # reading the log is not a request worth counting
            self.requests.record(
                RecordedRequest(
                    request.method,
                    path,
                    truthy(request.query.get("watch")),
                    request.headers.get("User-Agent", ""),
                )
            )
        try:
            return await self._dispatch(request)
        except ApiError as error:
            return _json(error.as_status(), status=error.code)
        except (json.JSONDecodeError, yaml.YAMLError) as error:
            return _json(bad_request(f"invalid body: {error}").as_status(), status=400)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        if request.method == "GET":
            static = self._non_resource(request, path)
            if static is not None:
                return static
        resource = parse_resource_path(self.emulator, path)
        if resource is None:
            raise no_such_resource()
        options = WriteOptions.from_query(request.query)
        if resource.name is None:
            return await self._collection(request, resource, options)
        return await self._object(request, resource, options)

    # --- collections: list, watch, create, delete a collection ----------------------------

    async def _collection(
        self, request: web.Request, resource: ResourceRequest, options: WriteOptions
    ) -> web.StreamResponse:
        em, method = self.emulator, request.method
        rtype, namespace = resource.rtype, resource.namespace
        if method == "POST":
            body = await _body(request)
            created = em.create(
                rtype, namespace, body, strict_fields=options.strict, dry_run=options.dry_run
            )
            return _json(created, status=201)
        if method not in ("GET", "DELETE"):
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")
        selection = _selection(request.query, namespace)
        if method == "DELETE":
            deleted = [
                em.delete(rtype, namespace, item["metadata"]["name"], dry_run=options.dry_run)
                for item in em.list(rtype, selection)
            ]
            return _json(_list_of(em, rtype, deleted))
        if truthy(request.query.get("watch")):
            stream = WatchStream(
                em, rtype, selection, WatchOptions.from_request(request), self.bookmark_interval
            )
            return await stream.run(request, self._stopping)
        items = em.list(rtype, selection)
        if wants_table(request.headers.get("Accept", "")):
            return _json(_table_of(request, em, rtype, items))
        return _json(_list_of(em, rtype, items))

    # --- one object: get, replace, patch, delete -------------------------------------------

    async def _object(
        self, request: web.Request, resource: ResourceRequest, options: WriteOptions
    ) -> web.StreamResponse:
        em, method = self.emulator, request.method
        rtype, namespace, name, sub = (
            resource.rtype,
            resource.namespace,
            resource.name,
            resource.subresource,
        )
        assert name is not None
        if sub in (EVICTION_SUBRESOURCE, BINDING_SUBRESOURCE) and method != "POST":
            raise ApiError(405, "MethodNotAllowed", f"{sub} takes POST only")
        if method == "GET":
            obj = em.get(rtype, namespace, name)
            if sub == SCALE_SUBRESOURCE:
                return _json(em.scale_of(rtype, obj))
            if wants_table(request.headers.get("Accept", "")):
                return _json(_table_of(request, em, rtype, [obj]))
            return _json(obj)
        if method == "DELETE":
            return _json(em.delete(rtype, namespace, name, dry_run=options.dry_run))
        if method == "PUT":
            body = await _body(request)
            return _json(self._write(resource, lambda _: body, options))
        if method == "PATCH":
            return await self._patch(request, resource, options)
        if method == "POST":
            return await self._post_to_pod(request, resource, options)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported")

    async def _post_to_pod(
        self, request: web.Request, resource: ResourceRequest, options: WriteOptions
    ) -> web.Response:
        """A pod's binding (by the scheduler) or eviction (PodDisruptionBudgets honoured)."""
        sub, namespace, name = resource.subresource, resource.namespace, resource.name
        assert name is not None and namespace is not None
        is_pod = resource.rtype.group == "" and resource.rtype.plural == "pods"
        if is_pod and sub == EVICTION_SUBRESOURCE:
            body = await _body(request)
            return _json(
                pod_actions.evict(self.emulator, namespace, name, body, dry_run=options.dry_run),
                status=201,
            )
        if is_pod and sub == BINDING_SUBRESOURCE:
            body = await _body(request)
            return _json(pod_actions.bind(self.emulator, namespace, name, body), status=201)
        raise ApiError(405, "MethodNotAllowed", f"POST to {sub} is not supported")

    def _write(
        self, resource: ResourceRequest, change: Change, options: WriteOptions
    ) -> dict[str, Any]:
        """A replace or a patch, of the object or of its /status or /scale."""
        assert resource.name is not None
        if resource.subresource == SCALE_SUBRESOURCE:
            return self._write_scale(resource, change, options.strict)
        return self.emulator.update(
            resource.rtype,
            resource.namespace,
            resource.name,
            change,
            subresource=resource.subresource,
            strict_fields=options.strict,
            dry_run=options.dry_run,
        )

    async def _patch(
        self, request: web.Request, resource: ResourceRequest, options: WriteOptions
    ) -> web.Response:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        text = await request.text()
        if content_type == APPLY_PATCH:
            manager = request.query.get("fieldManager")
            if not manager:
                raise bad_request("PATCH of type apply requires a fieldManager")
            return self._apply(resource, yaml.safe_load(text) or {}, manager, options)
        change = patch_change(resource, content_type, json.loads(text or "null"))
        return _json(self._write(resource, change, options))

    def _apply(
        self,
        resource: ResourceRequest,
        intent: dict[str, Any],
        manager: str,
        options: WriteOptions,
    ) -> web.Response:
        """Server-side apply: 201 when it created the object."""
        assert resource.name is not None
        if resource.subresource == SCALE_SUBRESOURCE:
            return _json(
                self._write_scale(resource, lambda scale: deep_merge(scale, intent), options.strict)
            )
        result, created = self.emulator.apply(
            resource.rtype,
            resource.namespace,
            resource.name,
            intent,
            manager,
            subresource=resource.subresource,
            strict_fields=options.strict,
            dry_run=options.dry_run,
        )
        return _json(result, status=201 if created else 200)

    def _write_scale(self, resource: ResourceRequest, change: Change, strict: bool) -> dict:
        em = self.emulator
        rtype, namespace, name = resource.rtype, resource.namespace, resource.name
        assert name is not None
        paths = rtype.scale
        assert paths is not None
        scale = change(em.scale_of(rtype, em.get(rtype, namespace, name)))
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise invalid(rtype, name, [("spec.replicas", "must be a non-negative integer")])

        def set_replicas(current: dict[str, Any]) -> dict[str, Any]:
            set_path(current, paths.spec_replicas, replicas)
            return current

        updated = em.update(
            rtype,
            namespace,
            name,
            set_replicas,
            subresource=None,
            strict_fields=strict,
            expected_version=(scale.get("metadata") or {}).get("resourceVersion"),
        )
        return em.scale_of(rtype, updated)

    # --- discovery and OpenAPI ------------------------------------------------------------

    def _non_resource(self, request: web.Request, path: str) -> web.Response | None:
        if path in HEALTH_PATHS:
            return web.Response(text="ok")
        if path == REQUESTS_PATH:
            try:
                since = int(request.query.get("since", "0"))
            except ValueError:
                raise bad_request("since must be an integer") from None
            agents = tuple(request.query.getall("agent", []))
            return _json(summary(self.requests, since, agents))
        if path == "/openapi/v2":
            return self._openapi_v2(request)
        if path == "/openapi/v3":
            groups = self.emulator.groups()
            group_versions = [(g, v) for g, versions in groups.items() for v in versions]
            return _json(openapi.v3_index(group_versions, self.emulator.revision))
        if path.startswith("/openapi/v3/"):
            return _json(self._openapi_v3_group_version(path[len("/openapi/v3/") :]))
        document = discovery.document(self.emulator, path)
        return None if document is None else _json(document)

    def _openapi_v2(self, request: web.Request) -> web.Response:
        document = openapi.v2(sorted(self.emulator.types.values(), key=_type_order))
        accept = request.headers.get("Accept", "")
        if openapi_v2_proto.MEDIA_TYPE in accept:
            return web.Response(
                # As a real server: the media type asked for has an @, which is no valid
                # Content-Type.
                body=openapi_v2_proto.document(document),
                content_type="application/octet-stream",
            )
        if not accept or "application/json" in accept or "*/*" in accept:
            return _json(document)
        raise ApiError(406, "NotAcceptable", f"/openapi/v2 is not served as {accept}")

    def _openapi_v3_group_version(self, gv_path: str) -> dict[str, Any]:
        parts = gv_path.split("/")
        if parts[:1] == ["api"] and len(parts) == 2:
            group, version = "", parts[1]
        elif parts[:1] == ["apis"] and len(parts) == 3:
            group, version = parts[1], parts[2]
        else:
            raise no_such_resource()
        types = self.emulator.types_in(group, version)
        if not types:
            raise no_such_resource()
        return openapi.v3_group_version(types)


def _type_order(rtype: ResourceType) -> tuple[str, str, str]:
    return (rtype.group, rtype.version, rtype.plural)


def patch_change(resource: ResourceRequest, content_type: str, patch: Any) -> Change:
    """The change a JSON, merge or strategic merge patch makes to the live object."""
    rtype, name = resource.rtype, resource.name or ""
    if content_type == "application/json-patch+json":
        return _json_patch_change(rtype, name, patch)
    if content_type == "application/merge-patch+json":
        return lambda current: merge_patch(current, patch)
    if content_type == "application/strategic-merge-patch+json":
        if rtype.schema is not None or rtype.group not in BUILTIN_GROUPS:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "strategic merge patch is not supported for custom resources",
            )
        return lambda current: strategic_merge_patch(current, patch)
    raise ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format: {content_type}",
    )


def _json_patch_change(rtype: ResourceType, name: str, patch: Any) -> Change:
    def change(current: dict[str, Any]) -> dict[str, Any]:
        try:
            return json_patch(current, patch)
        except JsonPatchTestFailed as failed:
            raise invalid(rtype, name, [(str(failed), "test operation failed")]) from None
        except (KeyError, IndexError, ValueError, TypeError) as error:
            raise invalid(rtype, name, [(str(error), "path not found")]) from None

    return change
