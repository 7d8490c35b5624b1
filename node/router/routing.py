"""One request's way to a backend: wait for a ready one if allowed, then ask the policy."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.api.errors import unavailable
from pagedllm.router.fleet import Backend, Fleet
from pagedllm.router.hashing import PromptHashes
from pagedllm.router.metrics import RouterMetrics
from pagedllm.router.policy import Candidate, Choice, Policy, choose, placement_key


@dataclass(frozen=True)
class RoutingSettings:
    policy: Policy = Policy.PREFIX
    load_bound: float = 1.25
    # Requests held while no backend is ready; 0: answer 503 at once.
    max_held_requests: int = 0
    hold_timeout: float = 600.0


@dataclass
class Router:
    fleet: Fleet
    settings: RoutingSettings
    metrics: RouterMetrics
    rng: random.Random = field(default_factory=random.Random)
    # Called when a request starts to wait (scale from zero asks for capacity then).
    on_hold: Callable[[], None] | None = None
    _turn: int = 0
    _held: int = 0

    @property
    def held(self) -> int:
        return self._held

    async def ready_backends(self) -> list[Backend]:
        """The ready backends; with none, hold the request for one (up to the limits) or
        refuse it with a 503 that says when to retry."""
        ready = self.fleet.ready()
        if ready:
            return ready
        s = self.settings
        if self._held >= s.max_held_requests:
            reason = "no_backend" if s.max_held_requests == 0 else "hold_full"
            self.metrics.rejected.labels(reason).inc()
            detail = "" if s.max_held_requests == 0 else f" and {self._held} requests wait for one"
            raise unavailable(f"no serving node is ready{detail}; retry the request", reason)
        self._held += 1
        self.metrics.held.inc()
        if self.on_hold is not None:
            self.on_hold()
        try:
            ready = await self.fleet.wait_ready(s.hold_timeout)
        finally:
            self._held -= 1
            self.metrics.held.dec()
        if not ready:
            self.metrics.rejected.labels("hold_timeout").inc()
            raise unavailable(
                f"no serving node became ready within --hold-timeout {s.hold_timeout:g} s; "
                "retry the request",
                "hold_timeout",
            )
        return ready

    def choose(self, token_ids: list[int], backends: list[Backend]) -> Choice:
        prompt = PromptHashes(token_ids)
        candidates = [
            Candidate(
                b.url, b.residency.cached_tokens(prompt.for_scheme(b.residency.scheme)), b.load
            )
            for b in backends
            if b.residency is not None
        ]
        if self.settings.policy == Policy.RANDOM:
            turn = self.rng.randrange(len(candidates))
        else:
            turn, self._turn = self._turn, self._turn + 1
        choice = choose(
            self.settings.policy,
            candidates,
            placement_key(token_ids),
            self.settings.load_bound,
            turn,
        )
        self.metrics.routed.labels(choice.reason.value).inc()
        self.metrics.cached_tokens.observe(choice.cached_tokens)
        return choice
