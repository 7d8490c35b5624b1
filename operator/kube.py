"""A small async Kubernetes API client for the operator's own calls (kopf watches; this
applies children, reads pods, writes status and /scale). Credentials are the ones kopf logs in
with, so both always talk to the same cluster as the same user."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import kopf

FIELD_MANAGER = "pagedllm-operator"

# The kinds the operator touches, to build their REST paths.
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ServiceMonitor": "servicemonitors",
    "PagedLLM": "pagedllms",
    "Pod": "pods",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "CustomResourceDefinition": "customresourcedefinitions",
}


class ApiError(Exception):
    def __init__(self, status: int, body: Any):
        reason = body.get("reason") if isinstance(body, dict) else None
        message = body.get("message") if isinstance(body, dict) else str(body)
        super().__init__(f"{status} {reason or ''}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def resource_path(
    api_version: str,
    kind: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = base + (f"/namespaces/{namespace}" if namespace else "") + "/" + PLURALS[kind]
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def _pem_file(data: str | bytes) -> str:
    handle = tempfile.NamedTemporaryFile(prefix="pagedllm-", suffix=".pem", delete=False)
    with handle:
        handle.write(base64.b64decode(data))
    return handle.name


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    context = ssl.create_default_context(
        cafile=info.ca_path,
        cadata=base64.b64decode(info.ca_data).decode() if info.ca_data else None,
    )
    certificate = info.certificate_path or (
        _pem_file(info.certificate_data) if info.certificate_data else None
    )
    key = info.private_key_path or (
        _pem_file(info.private_key_data) if info.private_key_data else None
    )
    if certificate:
        context.load_cert_chain(certificate, key)
    return context


class KubeClient:
    def __init__(self, login: Callable[[], kopf.ConnectionInfo | None]):
        # Called again on a 401: service-account tokens are rotated under a running pod.
        self._login = login
        self._client: httpx.AsyncClient | None = None

    def _connect(self) -> httpx.AsyncClient:
        info = self._login()
        if info is None:
            raise kopf.PermanentError(
                "no Kubernetes credentials: neither in-cluster nor a kubeconfig"
            )
        headers = {"Accept": "application/json", "User-Agent": FIELD_MANAGER}
        if info.token:
            headers["Authorization"] = f"Bearer {info.token}"
        auth = httpx.BasicAuth(info.username, info.password or "") if info.username else None
        server = info.server or "https://kubernetes.default.svc"
        verify = _ssl_context(info) if server.startswith("https") else True
        return httpx.AsyncClient(
            base_url=server, headers=headers, auth=auth, verify=verify, timeout=30, trust_env=False
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Any:
        content = json.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type} if content is not None else {}
        response = await self._send(method, path, content, headers, params)
        if response.status_code == 401:  # expired token: log in again, once
            await self.close()
            response = await self._send(method, path, content, headers, params)
        try:
            payload = response.json()
        except ValueError:
            payload = response.text
        if response.status_code >= 400:
            raise ApiError(response.status_code, payload)
        return payload

    async def _send(
        self,
        method: str,
        path: str,
        content: str | None,
        headers: Mapping[str, str],
        params: Mapping[str, str] | None,
    ) -> httpx.Response:
        if self._client is None:
            self._client = self._connect()
        return await self._client.request(
            method, path, content=content, headers=headers, params=params
        )

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        result = await self.request("GET", path, params={"labelSelector": label_selector})
        return result.get("items", [])

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply: we own exactly the fields we set, and fields we stop setting go."""
        metadata = manifest["metadata"]
        path = resource_path(
            manifest["apiVersion"], manifest["kind"], metadata.get("namespace"), metadata["name"]
        )
        return await self.request(
            "PATCH",
            path,
            body=manifest,
            content_type="application/apply-patch+yaml",
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
        )

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request(
            "PATCH", path, body=patch, content_type="application/merge-patch+json"
        )

    async def post_event(
        self, involved: Mapping[str, Any], *, type: str, reason: str, message: str, now: str
    ) -> None:
        """A core/v1 Event about `involved` (shown by `kubectl describe` and `get events`)."""
        metadata = involved["metadata"]
        event = {
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
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": socket.gethostname(),
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self.request("POST", f"/api/v1/namespaces/{metadata['namespace']}/events", body=event)

    async def delete(self, path: str) -> None:
        try:
            await self.request("DELETE", path, body={"propagationPolicy": "Background"})
        except ApiError as error:
            if error.status != 404:
                raise
