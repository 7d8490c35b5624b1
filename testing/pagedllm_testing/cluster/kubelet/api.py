"""The kubelet's API client: plain REST over httpx with the node's client certificate, as
`system:node:NAME` in `system:nodes`, so that the Node authorizer and NodeRestriction admit
exactly what they admit for a real kubelet."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx

MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class Api:
    def __init__(self, server: str, ca: Path, cert: Path, key: Path, agent: str):
        context = ssl.create_default_context(cafile=str(ca))
        context.load_cert_chain(str(cert), str(key))
        self.http = httpx.AsyncClient(
            base_url=server,
            verify=context,
            timeout=httpx.Timeout(30.0),
            trust_env=False,
            headers={"User-Agent": agent},
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        missing_ok: bool = False,
    ) -> dict[str, Any] | None:
        response = await self.http.request(
            method,
            path,
            content=None if body is None else json.dumps(body),
            params=params,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        if response.status_code == 404 and missing_ok:
            return None
        if response.status_code >= 400:
            raise ApiError(response.status_code, response.text[:500])
        return response.json() if response.content else {}

    async def get(self, path: str) -> dict[str, Any] | None:
        return await self.request("GET", path, missing_ok=True)

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        return await self.request("PATCH", path, body=patch, headers=MERGE_PATCH, missing_ok=True)

    async def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """The pod object removed for good once the kubelet is done with it: grace period 0,
        and only the pod of that uid (not a successor of the same name)."""
        await self.request(
            "DELETE",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            body={
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "gracePeriodSeconds": 0,
                "preconditions": {"uid": uid},
            },
            missing_ok=True,
        )

    async def watch(
        self, path: str, params: Mapping[str, Any], timeout: int
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request (it ends after ``timeout`` seconds)."""
        query = {**params, "watch": "true", "timeoutSeconds": str(timeout)}
        async with self.http.stream(
            "GET", path, params=query, timeout=httpx.Timeout(timeout + 10.0)
        ) as response:
            if response.status_code >= 400:
                raise ApiError(response.status_code, (await response.aread()).decode()[:500])
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)

    async def close(self) -> None:
        await self.http.aclose()
