"""One node's kubelet: registers the Node, renews its Lease, and runs the pods bound to it
(spec.nodeName, set by the real kube-scheduler) as local processes (pods.py), following them
with a watch on the pods of this node as a real kubelet does."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from pagedllm_testing.cluster import network
from pagedllm_testing.cluster.kubelet.api import Api, ApiError
from pagedllm_testing.cluster.kubelet.node import (
    LEASE_NAMESPACE,
    NodeSpec,
    lease_object,
    node_object,
    node_status,
    now,
)
from pagedllm_testing.cluster.kubelet.pods import (
    CONFIG_MAP_REFRESH_SECONDS,
    DEFAULT_GRACE_SECONDS,
    LocalPod,
    PodConfigError,
)

LEASE_RENEW_SECONDS = 5.0
STATUS_SECONDS = 30.0
WATCH_SECONDS = 60
RESYNC_SECONDS = 10.0
ERROR_PAUSE_SECONDS = 1.0


class Kubelet:
    def __init__(
        self,
        api: Api,
        node: NodeSpec,
        *,
        root: Path,
        bridge: network.Bridge,
        apiserver_port: int,
        version: str,
        bin_dirs: Sequence[str] = (),
        image_env: Mapping[str, str] | None = None,
        max_probe_period: float = 1.0,
    ):
        self.api = api
        self.node = node
        self.root = root
        self.ipam = root / "ipam"
        self.bridge = bridge
        self.host_address = bridge.host_address
        self.apiserver_host = bridge.host_address
        self.apiserver_port = apiserver_port
        self.version = version
        self.path_variable = os.pathsep.join([*bin_dirs, os.environ.get("PATH", "")])
        self.image_env = dict(image_env or {})
        self.max_probe_period = max_probe_period
        self.log_path = root / "nodes" / f"{node.name}.log"
        self.pods: dict[str, LocalPod] = {}
        self.probes = httpx.AsyncClient(trust_env=False)
        self._stopping: set[asyncio.Task[None]] = set()
        self._since = now()

    def log(self, message: str) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            log.write(f"{now()} {message}\n")

    # --- the node ----------------------------------------------------------------------------

    async def register(self) -> None:
        try:
            await self.api.request("POST", "/api/v1/nodes", body=node_object(self.node))
        except ApiError as error:
            if error.status != 409:  # registered before (a restarted kubelet)
                raise
        await self.report_status()
        lease = lease_object(self.node.name, now(micro=True))
        try:
            await self.api.request(
                "POST",
                f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases",
                body=lease,
            )
        except ApiError as error:
            if error.status != 409:
                raise
            await self.renew_lease()
        self.log(f"registered node {self.node.name}")

    async def report_status(self) -> None:
        status = node_status(self.node, self.host_address, self.version, self._since)
        await self.api.merge_patch(f"/api/v1/nodes/{self.node.name}/status", {"status": status})

    async def renew_lease(self) -> None:
        await self.api.merge_patch(
            f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.node.name}",
            {"spec": {"renewTime": now(micro=True), "holderIdentity": self.node.name}},
        )

    async def _heartbeat(self) -> None:
        last_status = time.monotonic()
        while True:
            await asyncio.sleep(LEASE_RENEW_SECONDS)
            try:
                await self.renew_lease()
                if time.monotonic() - last_status >= STATUS_SECONDS:
                    await self.report_status()
                    last_status = time.monotonic()
            except (ApiError, httpx.HTTPError) as error:
                self.log(f"heartbeat failed: {error!r}")

    # --- the pods ----------------------------------------------------------------------------

    async def run(self) -> None:
        await self.register()
        loop = asyncio.get_running_loop()
        background = [loop.create_task(self._heartbeat()), loop.create_task(self._refresh())]
        try:
            await self._follow_pods()
        finally:
            for task in background:
                task.cancel()

    async def _follow_pods(self) -> None:
        selector = {"fieldSelector": f"spec.nodeName={self.node.name}"}
        while True:
            try:
                listed = await self.api.request("GET", "/api/v1/pods", params=selector)
                assert listed is not None
                await self._sync_all(listed["items"])
                version = listed["metadata"]["resourceVersion"]
                deadline = time.monotonic() + RESYNC_SECONDS
                while time.monotonic() < deadline:
                    async for event in self.api.watch(
                        "/api/v1/pods", {**selector, "resourceVersion": version}, WATCH_SECONDS
                    ):
                        if event["type"] == "ERROR":
                            raise ApiError(int(event["object"].get("code", 500)), str(event))
                        pod = event["object"]
                        version = pod["metadata"]["resourceVersion"]
                        if event["type"] == "BOOKMARK":
                            continue
                        self._sync(pod, deleted=event["type"] == "DELETED")
                        if time.monotonic() >= deadline:
                            break
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log(f"following pods failed:\n{traceback.format_exc()}")
                await asyncio.sleep(ERROR_PAUSE_SECONDS)

    async def _sync_all(self, pods: list[dict[str, Any]]) -> None:
        seen = set()
        for pod in pods:
            seen.add(pod["metadata"]["uid"])
            self._sync(pod)
        for uid, local in list(self.pods.items()):
            if uid not in seen and not local.terminating:
                self._sync_gone(local)

    def _sync(self, pod: dict[str, Any], deleted: bool = False) -> None:
        uid = pod["metadata"]["uid"]
        local = self.pods.get(uid)
        if deleted:
            if local is not None and not local.terminating:
                self._sync_gone(local)
            return
        if pod["metadata"].get("deletionTimestamp"):
            if local is None:
                self._start_task(self._delete_unknown(pod))
            elif not local.terminating:
                grace = pod["metadata"].get(
                    "deletionGracePeriodSeconds",
                    pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS),
                )
                self._start_task(local.terminate(float(grace)))
            return
        if local is None and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            local = self.pods[uid] = LocalPod(self, pod)
            local.task = asyncio.get_running_loop().create_task(local.run())

    def _sync_gone(self, local: LocalPod) -> None:
        """Removed without a graceful deletion here (forced): stop it all the same."""
        grace = local.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
        self._start_task(local.terminate(float(grace), api=False))

    async def _delete_unknown(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        await self.api.delete_pod(meta["namespace"], meta["name"], meta["uid"])

    async def _refresh(self) -> None:
        """The running pods' configMap volumes brought up to date every few seconds (a real
        kubelet takes up to a minute or so)."""
        while True:
            await asyncio.sleep(CONFIG_MAP_REFRESH_SECONDS)
            for local in list(self.pods.values()):
                if local.dirs and not local.terminating:
                    with contextlib.suppress(PodConfigError):  # deleted under a running pod
                        await local.write_volumes(refresh=True)

    def _start_task(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    # --- the end -----------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Every pod process killed at once and the pods' networks removed (the node is
        lost); the pod objects stay, as a lost node's do."""
        tasks = [*self._stopping, *(p.task for p in self.pods.values() if p.task)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for local in self.pods.values():
            local.kill_all()
            local.remove_network()
        await self.probes.aclose()
        await self.api.close()
