"""A GitOps stand-in (test infrastructure): re-applies the repository's PagedLLM manifest every
few seconds, as Argo CD or Flux does, with server-side apply under a field manager of its own
and without `spec.replicas` (what docs/kubernetes/gitops.md tells GitOps users to leave out, so
that the autoscaler owns it).

After each apply it compares the PagedLLM and its Deployment with what they were just before:
an apply of a manifest that matches what is live must change neither `metadata.generation`
(no spec change, so no reconcile that does anything, no rollout) nor the replicas. A change
that coincides with the autoscaler's own write to `/scale` is told apart by the replicas having
moved too, and is not held against the apply.
"""

from __future__ import annotations

import copy
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

APPLY_PATCH = "application/apply-patch+yaml"
FIELD_MANAGER = "gitops-standin"


@dataclass(frozen=True)
class Seen:
    """What an apply may not move."""

    generation: int
    replicas: int | None
    deployment_generation: int | None
    deployment_replicas: int | None


@dataclass
class GitOpsStats:
    applies: int = 0
    # Applies during which the autoscaler also wrote (replicas moved): not counted either way.
    raced: int = 0
    problems: list[str] = field(default_factory=list)


def without_replicas(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest as a GitOps repository keeps it: `spec.replicas` left to the autoscaler."""
    kept = copy.deepcopy(dict(manifest))
    kept.get("spec", {}).pop("replicas", None)
    return kept


def raced(before: Seen, after: Seen) -> bool:
    """Whether the replicas moved meanwhile: the autoscaler wrote, and the generations with it."""
    return (before.replicas, before.deployment_replicas) != (
        after.replicas,
        after.deployment_replicas,
    )


def moved(before: Seen, after: Seen) -> str | None:
    """The generations an apply moved (None: neither)."""
    changes = []
    if before.generation != after.generation:
        changes.append(f"PagedLLM generation {before.generation} -> {after.generation}")
    if before.deployment_generation != after.deployment_generation:
        changes.append(
            f"Deployment generation {before.deployment_generation} -> {after.deployment_generation}"
        )
    return ", ".join(changes) or None


class GitOpsStandin:
    """``with GitOpsStandin(...) as gitops:`` applies every ``interval`` seconds until the
    block ends; ``gitops.stats`` says what it saw."""

    def __init__(
        self,
        server: str,
        namespace: str,
        manifest: Mapping[str, Any],
        interval: float = 3.0,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.server = server
        self.manifest = without_replicas(manifest)
        name = manifest["metadata"]["name"]
        self.path = f"/apis/pagedllm.io/v1alpha1/namespaces/{namespace}/pagedllms/{name}"
        self.deployment_path = f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"
        self.interval = interval
        self.stats = GitOpsStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gitops-standin", daemon=True)
        # ``verify``: the cluster's CA, and the stand-in's credentials (a client certificate).
        self._client = httpx.Client(base_url=server, timeout=10, trust_env=False, verify=verify)

    def __enter__(self) -> GitOpsStandin:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._client.close()

    def _seen(self) -> Seen:
        body = self._client.get(self.path).raise_for_status().json()
        deployment = self._client.get(self.deployment_path)
        dep = deployment.json() if deployment.status_code == 200 else {}
        return Seen(
            generation=body["metadata"]["generation"],
            replicas=body["spec"].get("replicas"),
            deployment_generation=(dep.get("metadata") or {}).get("generation"),
            deployment_replicas=(dep.get("spec") or {}).get("replicas"),
        )

    def apply_once(self) -> None:
        before = self._seen()
        answer = self._client.patch(
            self.path,
            content=yaml.safe_dump(self.manifest),
            params={"fieldManager": FIELD_MANAGER},
            headers={"content-type": APPLY_PATCH},
        )
        self.stats.applies += 1
        if answer.status_code != 200:
            self.stats.problems.append(f"apply answered {answer.status_code}: {answer.text}")
            return
        after = self._seen()
        if raced(before, after):
            self.stats.raced += 1
        elif (change := moved(before, after)) is not None:
            self.stats.problems.append(f"re-applying the same manifest moved {change}")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.apply_once()
            except (httpx.HTTPError, KeyError, ValueError) as error:
                self.stats.problems.append(f"apply failed: {error}")
