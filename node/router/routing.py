"""One request's way to a backend: wait for a ready one if allowed, then ask the policy."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.api.errors import unavailable
from pagedllm.router.fleet import Backend, Fleet
from pagedllm.router.hashing import PromptHashes
from pagedllm.router.metrics import RouterMetrics
from pagedllm.router.policy import Candidate, Choice, Policy, Reason, choose, placement_key

# How long the router counts a prompt as cached where it sent it, before the node's feed says
# so itself (the prefill of a long prompt on a busy node can take this long).
PENDING_S = 60.0
# Expired entries are swept once a backend's pending map grows by this many.
# (A LoRA adapter sent to a node counts as about to be loaded there for PENDING_S too, or
# until the feed lists it loaded.)
PENDING_SWEEP = 4096


@dataclass
class Pending:
    """Blocks a backend will hold once the requests sent to it are prefilled: hash -> until
    when it counts. Bridges the gap until the feed reports them (or forever does not)."""

    until: dict[bytes, float] = field(default_factory=dict)
    _sweep_at: int = PENDING_SWEEP

    def add(self, hashes: list[bytes], now: float) -> None:
        expiry = now + PENDING_S
        for h in hashes:
            self.until[h] = expiry
        if len(self.until) >= self._sweep_at:
            self.until = {h: t for h, t in self.until.items() if t > now}
            self._sweep_at = len(self.until) + PENDING_SWEEP

    def holds(self, h: bytes, now: float) -> bool:
        return self.until.get(h, 0.0) > now


def adapter_token(name: str) -> bytes:
    """A LoRA adapter's entry in a backend's ``Pending``: sent there, so about to be loaded."""
    return b"lora:" + name.encode()


def serving(backends: list[Backend], adapter: str | None) -> list[Backend]:
    """The backends a request may go to: for a LoRA adapter, those whose feed lists it."""
    if adapter is None:
        return backends
    return [b for b in backends if adapter in b.adapters]


def requested_adapter(model: str | None, backends: list[Backend]) -> str | None:
    """The LoRA adapter a request's ``model`` names, if a ready backend's feed lists it; else
    None, a request for the base model. A name that is neither goes to a node like one for the
    base model, and the node answers it with its own 404 (``model_not_found``), as without the
    router: the names the router was given may not be the nodes' (a router started with the
    model's directory in front of nodes serving it as ``pagedllm-demo``)."""
    if model is None or not any(model in b.adapters for b in backends):
        return None
    return model


def cached_tokens(backend: Backend, hashes: list[bytes], pending: Pending, now: float) -> int:
    """The leading tokens of a prompt the backend holds, or will once what was sent to it is
    prefilled."""
    residency = backend.residency
    if residency is None:
        return 0
    count = 0
    for h in hashes:
        if h not in residency.hashes and not pending.holds(h, now):
            break
        count += 1
    return count * residency.scheme.block_size


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
    _pending: dict[str, Pending] = field(default_factory=dict)
    _placed: dict[str, int] = field(default_factory=dict)

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

    def holds_all(
        self, prompt: PromptHashes, backends: list[Backend], adapter: str | None = None
    ) -> bool:
        """Whether some backend holds, or will, every full block of ``prompt``: only then can
        the tokens after them change the choice."""
        now = time.monotonic()
        for b in serving(backends, adapter):
            if b.residency is None:
                continue
            blocks = len(prompt.for_scheme(b.residency.scheme, _key(b, adapter)))
            if self._cached(prompt, b, now, adapter) == blocks * b.residency.scheme.block_size:
                return True
        return False

    def choose(
        self, prompt: PromptHashes, backends: list[Backend], adapter: str | None = None
    ) -> Choice:
        """Where ``prompt`` goes, among ``backends`` (for a LoRA ``adapter``, those serving
        it: ``requested_adapter`` made sure there is one)."""
        now = time.monotonic()
        ready = {b.url: b for b in serving(backends, adapter) if b.residency is not None}
        key = placement_key(prompt.token_ids, adapter)
        candidates = [
            Candidate(
                b.url,
                self._cached(prompt, b, now, adapter),
                b.load,
                self._placed.get(b.url, 0),
                b.prompts[key],
                *self._adapters_at(b, adapter, now),
            )
            for b in ready.values()
        ]
        if self.settings.policy == Policy.RANDOM:
            turn = self.rng.randrange(len(candidates))
        else:
            turn, self._turn = self._turn, self._turn + 1
        choice = choose(
            self.settings.policy,
            candidates,
            key,
            self.settings.load_bound,
            turn,
            adapter is not None,
        )
        chosen = choice.order[0]
        scheme = ready[chosen].residency.scheme  # type: ignore[union-attr]
        pending = self._pending_of(chosen)
        pending.add(prompt.for_scheme(scheme, _key(ready[chosen], adapter)), now)
        if adapter is not None:
            pending.add([adapter_token(adapter)], now)
        if choice.reason == Reason.FALLBACK:
            self._placed[chosen] = self._placed.get(chosen, 0) + 1
        self._forget_gone()
        self.metrics.routed.labels(choice.reason.value).inc()
        self.metrics.cached_tokens.observe(choice.cached_tokens)
        return choice

    def _cached(
        self, prompt: PromptHashes, backend: Backend, now: float, adapter: str | None
    ) -> int:
        """The leading tokens of ``prompt`` that ``backend`` (which has a residency and serves
        ``adapter``) holds, or will once what was sent to it is prefilled."""
        scheme = backend.residency.scheme  # type: ignore[union-attr]
        hashes = prompt.for_scheme(scheme, _key(backend, adapter))
        return cached_tokens(backend, hashes, self._pending_of(backend.url), now)

    def _adapters_at(self, backend: Backend, adapter: str | None, now: float) -> tuple[bool, int]:
        """Whether ``adapter`` is loaded at ``backend`` or about to be (sent there lately,
        until the feed says it is loaded: from then on the feed alone says, so that an
        eviction shows), and how many adapters are so there."""
        if adapter is None:
            return False, 0
        pending = self._pending_of(backend.url)
        count, this = 0, False
        for name, state in backend.adapters.items():
            token = adapter_token(name)
            if state.loaded:
                pending.until.pop(token, None)
            held = state.loaded or pending.holds(token, now)
            count += held
            this = this or (held and name == adapter)
        return this, count

    def _pending_of(self, url: str) -> Pending:
        pending = self._pending.get(url)
        if pending is None:
            pending = self._pending[url] = Pending()
        return pending

    def _forget_gone(self) -> None:
        """Drop what is kept of backends that left the fleet."""
        if len(self._pending) > len(self.fleet.backends):
            for url in [u for u in self._pending if u not in self.fleet.backends]:
                del self._pending[url]
                self._placed.pop(url, None)


def _key(backend: Backend, adapter: str | None) -> tuple[str, str] | None:
    """The adapter's identity at ``backend`` (its prefix-cache root): the name and the path
    that node loads it from, which may differ between nodes."""
    return None if adapter is None else backend.adapters[adapter].key
