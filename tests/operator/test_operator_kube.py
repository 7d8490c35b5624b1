"""The operator's API client (the official client's dynamic client, driven from asyncio) against
the real kube-apiserver, logged in as a ServiceAccount with tokens from the TokenRequest API:
kopf's credentials go with every call, a token the apiserver stops accepting is replaced by the
login's current one, errors come out as the reconcile code expects them, and kopf's event loop
keeps running while a call waits on the network."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import kopf
import pytest

from pagedllm.operator.kube import FIELD_MANAGER, ApiError, KubeClient, KubeError
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.operator_harness import AuditLog, Kube, TcpProxy, eventually, token_id

# Where an audit event names the token a request came with (JTI=<the token's jti>).
CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"


@dataclass
class Account:
    """A ServiceAccount of the test's, allowed to manage ConfigMaps in its namespace."""

    cluster: ControlPlane
    kube: Kube
    namespace: str
    name: str = "client"

    def token(self, bound_to: str | None = None) -> str:
        """A token from the TokenRequest API; bound to a Secret named `bound_to` (created
        here) if given, so that deleting the Secret revokes it."""
        spec: dict[str, Any] = {"expirationSeconds": 3600}
        if bound_to is not None:
            secret = self.kube.create(self.path("secrets"), {"metadata": {"name": bound_to}})
            spec["boundObjectRef"] = {
                "apiVersion": "v1",
                "kind": "Secret",
                "name": bound_to,
                "uid": secret["metadata"]["uid"],
            }
        request = self.kube.create(self.path(f"serviceaccounts/{self.name}/token"), {"spec": spec})
        return request["status"]["token"]

    def revoke(self, bound_to: str, token: str) -> None:
        """The token bound to Secret `bound_to` revoked, once the apiserver refuses it (it
        remembers a token it accepted for 10 s)."""
        self.kube.delete(self.path(f"secrets/{bound_to}"))
        with httpx.Client(
            base_url=self.cluster.server, verify=self.cluster.ssl_context(), trust_env=False
        ) as http:

            def refused() -> bool:
                answer = http.get(
                    self.path("configmaps"), headers={"Authorization": f"Bearer {token}"}
                )
                return answer.status_code == 401

            eventually(refused, timeout=20, interval=0.5, what="the revoked token refused")

    def path(self, resource: str) -> str:
        return f"/api/v1/namespaces/{self.namespace}/{resource}"


@pytest.fixture(scope="module")
def account(cluster: ControlPlane, kube: Kube) -> Iterator[Account]:
    namespace = f"kube-client-{uuid.uuid4().hex[:8]}"
    kube.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
    found = Account(cluster, kube, namespace)
    kube.create(found.path("serviceaccounts"), {"metadata": {"name": found.name}})
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    kube.create(
        f"{rbac}/roles",
        {
            "metadata": {"name": "configmaps"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "verbs": ["get", "list", "create", "patch", "update", "delete"],
                }
            ],
        },
    )
    kube.create(
        f"{rbac}/rolebindings",
        {
            "metadata": {"name": "configmaps"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "configmaps",
            },
            "subjects": [{"kind": "ServiceAccount", "name": found.name, "namespace": namespace}],
        },
    )
    yield found
    kube.delete(f"/api/v1/namespaces/{namespace}")


@dataclass
class Login:
    """kopf's login handler: the token it hands out is `token` as of each login."""

    server: str
    cluster: ControlPlane
    token: str
    count: int = 0

    def __call__(self) -> kopf.ConnectionInfo:
        self.count += 1
        return kopf.ConnectionInfo(server=self.server, ca_path=self.cluster.ca, token=self.token)


def config_map(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace},
        "data": {"key": "value"},
    }


def test_credentials_and_a_rotated_token(cluster: ControlPlane, account: Account) -> None:
    """The first token works until it is revoked; the call that gets the 401 logs in again,
    once, and goes on with the new token, which the caller never notices."""
    first = account.token(bound_to="first")
    login = Login(cluster.server, cluster, first)
    audit = AuditLog(cluster)

    async def scenario() -> None:
        kube = KubeClient(login)
        try:
            await kube.create(config_map("rotated", account.namespace))
            # The token rotated under the pod: the login hands out the new one, and the old
            # one is refused from now on.
            login.token = account.token(bound_to="second")
            await asyncio.to_thread(account.revoke, "first", first)
            live = await kube.get("v1", "ConfigMap", "rotated", account.namespace)
            assert live is not None and live["data"] == {"key": "value"}
        finally:
            await kube.close()

    asyncio.run(scenario())
    assert login.count == 2  # logged in again after the 401, once
    calls = [
        (e["responseStatus"]["code"], (e["user"].get("extra") or {}).get(CREDENTIAL_ID, [""])[0])
        for e in audit.read()
        if e["userAgent"] == FIELD_MANAGER
    ]
    first_id, second_id = token_id(first), token_id(login.token)
    used = [credential for _, credential in calls]
    assert first_id in used and second_id in used
    # One request refused (401): the first token until then, the second after.
    (refused,) = [i for i, (code, _) in enumerate(calls) if code == 401]
    assert set(used[:refused]) == {first_id}
    assert set(used[refused + 1 :]) == {second_id}


def test_errors_as_the_reconcile_code_handles_them(cluster: ControlPlane, account: Account) -> None:
    """Absent objects read as None and delete as done; AlreadyExists, NotFound and Forbidden come
    out as ApiError with the apiserver's status and reason; a kind the apiserver does not serve
    reads as absent and cannot be applied."""
    namespace = account.namespace

    async def scenario() -> None:
        kube = KubeClient(Login(cluster.server, cluster, account.token()))
        try:
            assert await kube.get("v1", "ConfigMap", "absent", namespace) is None
            await kube.delete("v1", "ConfigMap", "absent", namespace)  # already gone: fine
            await kube.create(config_map("twice", namespace))
            with pytest.raises(ApiError) as exists:
                await kube.create(config_map("twice", namespace))
            assert (exists.value.status, exists.value.reason) == (409, "AlreadyExists")
            with pytest.raises(ApiError) as missing:
                await kube.merge_patch("v1", "ConfigMap", "absent", namespace, {"data": {}})
            assert missing.value.status == 404 and "absent" in missing.value.message
            patch = {"data": {}}
            gone = await kube.merge_patch(
                "v1", "ConfigMap", "absent", namespace, patch, missing_ok=True
            )
            assert gone is None
            # Not allowed by the account's Role: the apiserver's 403, with its reason.
            with pytest.raises(ApiError) as forbidden:
                await kube.get("v1", "Secret", "first", namespace)
            assert (forbidden.value.status, forbidden.value.reason) == (403, "Forbidden")
            assert f"system:serviceaccount:{namespace}:{account.name}" in forbidden.value.message
            # A kind the server does not serve: no such object, and nothing to apply it to.
            assert await kube.get("example.com/v1", "Nothing", "x", namespace) is None
            unserved = {
                "apiVersion": "example.com/v1",
                "kind": "Nothing",
                "metadata": {"name": "x", "namespace": namespace},
            }
            with pytest.raises(ApiError) as not_served:
                await kube.apply(unserved)
            assert not_served.value.status == 404 and "example.com/v1" in not_served.value.message
        finally:
            await kube.close()

    asyncio.run(scenario())


def test_an_unreachable_server_is_a_kube_error() -> None:
    """Nothing listening at the server's address: a KubeError, not the client library's own."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there

    async def scenario() -> None:
        kube = KubeClient(lambda: kopf.ConnectionInfo(server=f"https://127.0.0.1:{port}"))
        with pytest.raises(KubeError):
            await kube.get("v1", "ConfigMap", "any", "default")

    asyncio.run(scenario())


DELAY = 0.5


def test_the_event_loop_runs_while_a_call_waits(cluster: ControlPlane, account: Account) -> None:
    """Between the client and the apiserver, a forwarder holds every answer back half a
    second: while a call waits, the event loop's other tasks run."""
    address = urlsplit(cluster.server)
    with TcpProxy((address.hostname or "127.0.0.1", address.port or 443)) as proxy:

        async def scenario() -> tuple[int, float]:
            kube = KubeClient(Login(proxy.url, cluster, account.token()))
            try:
                await kube.create(config_map("slow", account.namespace))
                ticks = 0

                async def tick() -> None:
                    nonlocal ticks
                    while True:
                        await asyncio.sleep(0.01)
                        ticks += 1

                ticker = asyncio.create_task(tick())
                proxy.delay = DELAY
                started = time.monotonic()
                await kube.get("v1", "ConfigMap", "slow", account.namespace)
                waited = time.monotonic() - started
                ticker.cancel()
                return ticks, waited
            finally:
                proxy.delay = 0
                await kube.close()

        ticks, waited = asyncio.run(scenario())
    assert waited >= DELAY
    # A call that blocked the loop would leave no tick to the ticker while it waited.
    assert ticks > 0
