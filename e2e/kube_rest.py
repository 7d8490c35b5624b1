"""A small asynchronous REST client for the Kubernetes API, as the e2e stand-ins use it (the
kubelet and the Service proxy talk to the API emulator the way the real ones talk to an API
server: list, create, patch, delete)."""

from __future__ import annotations

import json
from typing import Any

import httpx


class KubeApiError(Exception):
    def __init__(self, status: int, body: Any):
        message = body.get("message") if isinstance(body, dict) else str(body)
        super().__init__(f"{status}: {message}")
        self.status = status


def collection_path(api_version: str, plural: str, namespace: str) -> str:
    base = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    return f"{base}/namespaces/{namespace}/{plural}"


class KubeRest:
    def __init__(self, server: str):
        self.http = httpx.AsyncClient(base_url=server, timeout=10, trust_env=False)

    async def close(self) -> None:
        await self.http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> Any:
        response = await self.http.request(
            method,
            path,
            params=params,
            content=None if body is None else json.dumps(body),
            headers={"Content-Type": content_type},
        )
        payload = response.json() if response.content else None
        if response.status_code >= 400:
            raise KubeApiError(response.status_code, payload)
        return payload

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except KubeApiError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        return (await self.request("GET", path, params=params))["items"]

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body)

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        """None when the object is gone (a stand-in racing a deletion is not an error)."""
        try:
            return await self.request("PATCH", path, patch, "application/merge-patch+json")
        except KubeApiError as error:
            if error.status == 404:
                return None
            raise

    async def delete(self, path: str) -> None:
        try:
            await self.request("DELETE", path)
        except KubeApiError as error:
            if error.status != 404:
                raise
