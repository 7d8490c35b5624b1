"""The operator's own calls to the Kubernetes API (kopf watches; this applies children, reads
pods, writes status and /scale, posts Events), through the official client's dynamic client.

Credentials are the ones kopf logs in with, so both always talk to the same cluster as the
same user. The official client is synchronous: each call runs in a worker thread, so kopf's
event loop never waits on the network."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import kopf
import kubernetes.client
import urllib3
from kubernetes.dynamic import DynamicClient, Resource
from kubernetes.dynamic.exceptions import (
    DynamicApiError,
    ResourceNotFoundError,
    UnauthorizedError,
)

FIELD_MANAGER = "pagedllm-operator"
IN_CLUSTER_SERVER = "https://kubernetes.default.svc"
REQUEST_TIMEOUT_SECONDS = 30.0
MERGE_PATCH = "application/merge-patch+json"

Result = TypeVar("Result")


def now_rfc3339() -> str:
    """A Kubernetes timestamp (metav1.Time: RFC 3339 in UTC, to the second)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeError(Exception):
    """A call to the API server failed: unreachable, or answered with an error (ApiError)."""


class ApiError(KubeError):
    """The API server answered with an error status (404 NotFound, 409 Conflict, 422...)."""

    def __init__(self, status: int, reason: str | None, message: str):
        super().__init__(f"{status} {reason or ''}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @classmethod
    def from_response(cls, error: DynamicApiError) -> ApiError:
        try:
            body = json.loads(error.body or "")
        except ValueError:
            body = None
        if isinstance(body, dict):
            return cls(error.status, body.get("reason"), str(body.get("message", "")))
        return cls(error.status, error.reason, str(error.body or ""))


def _plain(_client: DynamicClient, body: Any) -> Any:
    """The dynamic client's serializer that keeps the answer as parsed JSON."""
    return body


def _pem(data: str | bytes) -> str:
    """kubeconfig's *-data fields are base64 of PEM; kopf may also hand over the PEM itself."""
    text = data.decode() if isinstance(data, bytes) else data
    return text if text.lstrip().startswith("-----BEGIN") else base64.b64decode(text).decode()


class _Client(DynamicClient):
    """The dynamic client with a timeout on every request, discovery's included (the
    library's default is to wait forever)."""

    def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        params.setdefault("_request_timeout", REQUEST_TIMEOUT_SECONDS)
        return super().request(method, path, body, **params)


class _Connection:
    """One logged-in dynamic client, with the files its TLS settings need."""

    def __init__(self, info: kopf.ConnectionInfo, agent: str):
        self._files: list[str] = []
        self._cache_dir = tempfile.TemporaryDirectory(prefix="pagedllm-discovery-")
        configuration = kubernetes.client.Configuration(
            host=info.server or IN_CLUSTER_SERVER,
            ssl_ca_cert=os.fsdecode(info.ca_path) if info.ca_path else None,
            ca_cert_data=_pem(info.ca_data) if info.ca_data else None,
            cert_file=self._path_of(info.certificate_path, info.certificate_data),
            key_file=self._path_of(info.private_key_path, info.private_key_data),
            verify_ssl=not info.insecure,
            # As kopf's own session: the proxy it was given, the environment's only if trusted.
            proxy=info.proxy_url or (None if info.trust_env else ""),
        )
        api = kubernetes.client.ApiClient(configuration)
        api.user_agent = agent
        for header, value in info.as_http_headers().items():
            api.set_default_header(header, value)
        try:
            # Discovery is cached in a directory of its own: the library's default (one file
            # per server address under /tmp) would be shared by every process on this machine.
            self.client = _Client(api, cache_file=os.path.join(self._cache_dir.name, "discovery"))
        except BaseException:  # the first discovery requests failed
            api.close()
            self._remove_files()
            raise

    def _path_of(
        self, path: str | bytes | os.PathLike[Any] | None, data: str | bytes | None
    ) -> str | None:
        """A certificate or key as a file (the client reads them from files only)."""
        if path:
            return os.fsdecode(path)
        if not data:
            return None
        with tempfile.NamedTemporaryFile(
            "w", prefix="pagedllm-", suffix=".pem", delete=False
        ) as handle:
            handle.write(_pem(data))
        self._files.append(handle.name)
        return handle.name

    def close(self) -> None:
        self.client.client.close()
        self._remove_files()

    def _remove_files(self) -> None:
        for path in self._files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._cache_dir.cleanup()


class KubeClient:
    """Async calls to the API server; objects go in and come out as plain dicts.

    `agent` names the caller to the API server: its User-Agent, its field manager in
    server-side apply and the source of its Events."""

    def __init__(
        self, login: Callable[[], kopf.ConnectionInfo | None], *, agent: str = FIELD_MANAGER
    ):
        # Called again on a 401: service-account tokens are rotated under a running pod.
        self._login = login
        self.agent = agent
        self._connection: _Connection | None = None
        # Connecting and discovery (the library's resource cache) are not thread-safe.
        self._lock = threading.Lock()

    # --- the calls ---------------------------------------------------------------------------

    async def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self._call(
                api_version,
                kind,
                lambda r: r.get(name=name, namespace=namespace, serializer=_plain),
            )
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        result = await self._call(
            api_version,
            kind,
            lambda r: r.get(namespace=namespace, label_selector=label_selector, serializer=_plain),
        )
        return result.get("items") or []

    async def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call(
            body["apiVersion"],
            body["kind"],
            lambda r: r.create(body=dict(body), serializer=_plain),
        )

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply: we own exactly the fields we set, and fields we stop setting go."""
        return await self._call(
            manifest["apiVersion"],
            manifest["kind"],
            lambda r: r.server_side_apply(
                body=dict(manifest),
                field_manager=self.agent,
                force_conflicts=True,
                serializer=_plain,
            ),
        )

    async def merge_patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
        missing_ok: bool = False,
    ) -> dict[str, Any] | None:
        """A JSON merge patch of the object, or of its `status` or `scale` subresource. With
        `missing_ok`, an object already gone is no error (None)."""

        def call(resource: Resource) -> Any:
            target = resource
            if subresource is not None:
                if subresource not in resource.subresources:
                    raise ApiError(404, "NotFound", f"{kind} has no {subresource} subresource")
                target = resource.subresources[subresource]
            return target.patch(
                body=dict(patch),
                name=name,
                namespace=namespace,
                content_type=MERGE_PATCH,
                serializer=_plain,
            )

        try:
            return await self._call(api_version, kind, call)
        except ApiError as error:
            if missing_ok and error.status == 404:
                return None
            raise

    async def delete(self, api_version: str, kind: str, name: str, namespace: str) -> None:
        """Delete in the background (dependents go after); an object already gone is fine."""
        try:
            await self._call(
                api_version,
                kind,
                lambda r: r.delete(
                    name=name,
                    namespace=namespace,
                    body={"propagationPolicy": "Background"},
                    serializer=_plain,
                ),
            )
        except ApiError as error:
            if error.status != 404:
                raise

    async def post_event(
        self, involved: Mapping[str, Any], *, type: str, reason: str, message: str
    ) -> None:
        """A core/v1 Event about `involved` (shown by `kubectl describe` and `get events`)."""
        metadata = involved["metadata"]
        now = now_rfc3339()
        await self.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {
                    "generateName": f"{metadata['name']}.",
                    "namespace": metadata["namespace"],
                },
                "involvedObject": {
                    "apiVersion": involved["apiVersion"],
                    "kind": involved["kind"],
                    "name": metadata["name"],
                    "namespace": metadata["namespace"],
                    "uid": metadata["uid"],
                },
                "type": type,
                "reason": reason,
                "message": message[:1024],
                "source": {"component": self.agent},
                "reportingComponent": self.agent,
                "reportingInstance": socket.gethostname(),
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
        )

    async def close(self) -> None:
        await asyncio.to_thread(self._disconnect)

    # --- in the worker thread ----------------------------------------------------------------

    async def _call(
        self, api_version: str, kind: str, call: Callable[[Resource], Result]
    ) -> Result:
        return await asyncio.to_thread(self._call_blocking, api_version, kind, call)

    def _call_blocking(
        self, api_version: str, kind: str, call: Callable[[Resource], Result]
    ) -> Result:
        try:
            try:
                return call(self._resource(api_version, kind))
            except UnauthorizedError:  # an expired token: log in again, once
                self._disconnect()
                return call(self._resource(api_version, kind))
        except DynamicApiError as error:
            raise ApiError.from_response(error) from None
        except ResourceNotFoundError:
            raise ApiError(
                404, "NotFound", f"the server does not serve {api_version} {kind}"
            ) from None
        except urllib3.exceptions.HTTPError as error:
            raise KubeError(f"the API server could not be reached: {error}") from error

    def _resource(self, api_version: str, kind: str) -> Resource:
        """The resource type from discovery, fetched on first use (a kind not in the cache,
        such as a CRD created since, makes the library discover again)."""
        with self._lock:
            if self._connection is None:
                info = self._login()
                if info is None:
                    raise kopf.PermanentError(
                        "no Kubernetes credentials: neither in-cluster nor a kubeconfig"
                    )
                self._connection = _Connection(info, self.agent)
            # The prefix keeps a core kind (v1 Event) from matching other groups' v1 (and
            # from discovering every group to find out).
            prefix = "apis" if "/" in api_version else "api"
            return self._connection.client.resources.get(
                prefix=prefix, api_version=api_version, kind=kind
            )

    def _disconnect(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None
