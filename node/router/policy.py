"""Which node gets a request: pure functions of what each candidate holds and how busy it is.

``prefix`` sends a request to the node holding the longest cached prefix of its prompt, unless
that prompt's own requests there are above the load bound (consistent hashing with bounded
loads: no more than ``load_bound`` times a node's fair share of the requests in flight, this one
included); then to the least-loaded node. The bound counts only the prompt's own requests on
the nodes caching it because of what a move costs: moving one request off a node busy with
several prompts prefills the whole prompt on a node whose cache holds other prompts, evicting
one of them for the next request that needs it (in ``bench/fleet.py`` a bound on each node's
total load lost a third of the fleet's prefix hits this way), while a prompt whose own requests
exceed the bound (one hot system prompt) overflows, and its copy on the next node is worth its
memory. Nodes not caching the prompt are bounded by their total load.

A prompt cached nowhere goes to the node a rendezvous hash of its leading tokens picks among
those within the bound that have had the fewest such placements, so that new prompts spread
evenly over the nodes' caches (the router remembers where it sent a prompt until the node's
feed reports it cached: requests sharing a system prompt land together and the next ones find
it cached). ``least-load``, ``round-robin`` and ``random`` (what a
Kubernetes Service does, for comparisons) ignore the caches.

A request for a LoRA adapter goes only to nodes that serve it (the router filters them before
asking here, whatever the policy). Under ``prefix`` it prefers, within the load bound, the
nodes holding the adapter loaded (a load reads its files and may evict another adapter there),
by cached prefix among them; held nowhere within the bound and cached nowhere, it goes to the
node holding the fewest adapters loaded, so that a fleet's adapters spread over its nodes'
LRUs instead of chasing each other out of one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

# Leading tokens that place a prompt cached nowhere: enough to tell system prompts apart past a
# chat template's fixed opening, few enough that requests sharing only a long prompt's start
# still land together.
PLACEMENT_TOKENS = 128


class Policy(str, Enum):
    PREFIX = "prefix"
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


class Reason(str, Enum):
    """Why a request went where it went (the router's ``requests routed`` metric)."""

    PREFIX = "prefix"  # the longest cached prefix, within the load bound
    LOAD = "load"  # least loaded: the caching nodes were over the bound, or nothing to place by
    FALLBACK = "fallback"  # cached nowhere: placed by the hash of its leading tokens
    ADAPTER = "adapter"  # a LoRA adapter's request, where the adapter is (or goes) loaded
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


@dataclass(frozen=True)
class Candidate:
    url: str
    cached_tokens: int  # the leading tokens of this prompt the node holds
    load: int  # requests running and waiting there
    placed: int = 0  # prompts cached nowhere that were sent there so far
    prompt_load: int = 0  # requests with this prompt's placement key in flight there
    adapter_loaded: bool = False  # the request's LoRA adapter is (or is about to be) loaded
    adapters_loaded: int = 0  # LoRA adapters loaded there, or about to be


@dataclass(frozen=True)
class Choice:
    order: list[str]  # the nodes to try, best first (the rest only when the first refuses)
    reason: Reason
    cached_tokens: int  # what the first node is predicted to hold
    key: bytes  # the prompt's placement key


def placement_key(token_ids: Sequence[int], adapter: str | None = None) -> bytes:
    """The prompt's leading tokens, and its adapter: the same tokens for another adapter are
    another prompt to the caches."""
    head = ",".join(map(str, token_ids[:PLACEMENT_TOKENS])).encode()
    if adapter is not None:
        head += b"|lora:" + adapter.encode()
    return hashlib.blake2b(head, digest_size=16).digest()


def rendezvous(key: bytes, url: str) -> int:
    """Highest-random-weight score: each key ranks the nodes its own way, and a node coming or
    going moves only the keys it wins or won."""
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")


def capacity(loads: Sequence[int], load_bound: float) -> int:
    """The most requests one node may have, the new one included: ``load_bound`` times the
    mean once the new request is counted (never below one, so an idle fleet takes requests)."""
    return max(1, math.ceil(load_bound * (sum(loads) + 1) / len(loads)))


def choose(
    policy: Policy,
    candidates: Sequence[Candidate],
    key: bytes,
    load_bound: float,
    turn: int,
    adapter: bool = False,
) -> Choice:
    """``candidates``: the ready nodes (at least one; for a LoRA adapter's request, those
    serving it). ``key``: the prompt's placement key. ``turn``: the round-robin counter, or a
    random draw for ``random``. ``adapter``: the request names a LoRA adapter."""
    if not candidates:
        raise ValueError("no candidates to choose from")
    ordered = sorted(candidates, key=lambda c: c.url)
    if policy == Policy.ROUND_ROBIN:
        return _first(ordered[turn % len(ordered)], candidates, key, Reason.ROUND_ROBIN)
    if policy == Policy.RANDOM:
        return _first(ordered[turn % len(ordered)], candidates, key, Reason.RANDOM)
    if policy == Policy.LEAST_LOAD:
        return _first(_least_loaded(candidates, key), candidates, key, Reason.LOAD)
    return _prefix(candidates, key, load_bound, adapter)


def bounded_load(candidate: Candidate) -> int:
    """The load the bound applies to: on a node caching part of the prompt, only this prompt's
    own requests there; on any other node, all of them."""
    return candidate.prompt_load if candidate.cached_tokens > 0 else candidate.load


def _prefix(
    candidates: Sequence[Candidate], key: bytes, load_bound: float, adapter: bool
) -> Choice:
    cap = capacity([c.load for c in candidates], load_bound)
    within = [c for c in candidates if bounded_load(c) + 1 <= cap]
    if adapter:
        choice = _by_adapter(candidates, within, key)
        if choice is not None:
            return choice
    best = max(within, key=lambda c: (c.cached_tokens, -c.load, rendezvous(key, c.url)))
    if best.cached_tokens > 0:
        return _first(best, candidates, key, Reason.PREFIX)
    if any(c.cached_tokens > 0 for c in candidates):
        return _first(_least_loaded(within, key), candidates, key, Reason.LOAD)
    placed = min(within, key=lambda c: (c.placed, -rendezvous(key, c.url)))
    return _first(placed, candidates, key, Reason.FALLBACK)


def _by_adapter(
    candidates: Sequence[Candidate], within: Sequence[Candidate], key: bytes
) -> Choice | None:
    """An adapter request's node: one within the bound holding it loaded (the longest cached
    prefix among them), else, when no node caches the prompt, the one holding the fewest
    adapters; None leaves it to the prompt's rules."""
    held = [c for c in within if c.adapter_loaded]
    if held:
        best = max(held, key=lambda c: (c.cached_tokens, -c.load, rendezvous(key, c.url)))
        reason = Reason.PREFIX if best.cached_tokens > 0 else Reason.ADAPTER
        return _first(best, candidates, key, reason)
    if any(c.cached_tokens > 0 for c in candidates):
        return None
    emptiest = min(within, key=lambda c: (c.adapters_loaded, c.load, -rendezvous(key, c.url)))
    return _first(emptiest, candidates, key, Reason.ADAPTER)


def _least_loaded(candidates: Sequence[Candidate], key: bytes) -> Candidate:
    return min(candidates, key=lambda c: (c.load, -rendezvous(key, c.url)))


def _first(
    chosen: Candidate, candidates: Sequence[Candidate], key: bytes, reason: Reason
) -> Choice:
    """``chosen`` first, then the others by what they hold and how busy they are."""
    rest = sorted(
        (c for c in candidates if c.url != chosen.url),
        key=lambda c: (-c.cached_tokens, c.load, -rendezvous(key, c.url)),
    )
    return Choice([chosen.url, *(c.url for c in rest)], reason, chosen.cached_tokens, key)
