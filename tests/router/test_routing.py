"""The router's choices over a fleet: new prompts spread evenly over the nodes, and a prompt
just sent somewhere counts as cached there until the node's feed says so itself."""

from __future__ import annotations

import asyncio

from pagedllm.router.feed_messages import Adapter, Load
from pagedllm.router.fleet import Backend, Fleet
from pagedllm.router.hashing import HashScheme, PromptHashes, block_hashes
from pagedllm.router.metrics import RouterMetrics
from pagedllm.router.policy import Reason
from pagedllm.router.residency import Residency
from pagedllm.router.routing import Router, RoutingSettings, requested_adapter

URLS = ["http://a:1", "http://b:1", "http://c:1"]
SCHEME = HashScheme(16, 0)


def prompt(system: int, question: int) -> list[int]:
    return [5 + system] * 256 + [100 + question] * 32


async def no_feed(backend: Backend, fleet: Fleet) -> None:
    return None


def fleet_of_three() -> tuple[Fleet, Router]:
    fleet = Fleet(no_feed)
    fleet.set_backends(URLS)
    for backend in fleet.backends.values():
        backend.residency = Residency(SCHEME)
        backend.feed_load = Load(running=0, waiting=0, kv_usage=0.0)
    return fleet, Router(fleet, RoutingSettings(), RouterMetrics(fleet))


def test_new_prompts_spread_evenly_and_their_twins_follow() -> None:
    async def scenario() -> None:
        fleet, router = fleet_of_three()
        first: dict[int, str] = {}
        for system in range(8):
            choice = router.choose(PromptHashes(prompt(system, 0)), fleet.ready())
            assert choice.reason == Reason.FALLBACK
            first[system] = choice.order[0]
        per_node = sorted(list(first.values()).count(u) for u in URLS)
        assert per_node == [2, 3, 3]
        # Before any feed reports them, the twins go where their prompt went, as prefix hits.
        for system in range(8):
            choice = router.choose(PromptHashes(prompt(system, 1)), fleet.ready())
            assert choice.order[0] == first[system]
            assert choice.reason == Reason.PREFIX and choice.cached_tokens == 256
        await fleet.close()

    asyncio.run(scenario())


def test_what_the_feed_reports_wins_over_where_the_router_sent() -> None:
    async def scenario() -> None:
        fleet, router = fleet_of_three()
        sent = router.choose(PromptHashes(prompt(0, 0)), fleet.ready()).order[0]
        # Meanwhile another node reports holding the whole prompt and more.
        other = next(u for u in URLS if u != sent)
        longer = prompt(0, 0) + [9] * 64
        fleet.backends[other].residency = Residency(SCHEME, set(block_hashes(longer, SCHEME)))
        choice = router.choose(PromptHashes(longer), fleet.ready())
        assert choice.order[0] == other and choice.cached_tokens == 352
        # A backend that left is forgotten.
        fleet.set_backends([u for u in URLS if u != sent])
        router.choose(PromptHashes(prompt(1, 0)), fleet.ready())
        assert sent not in router._pending
        await fleet.close()

    asyncio.run(scenario())


def test_a_head_decides_unless_a_node_holds_all_of_it() -> None:
    """Only a node holding (or about to hold) every block of a prompt's head could gain from
    the tokens after it, so only then is the whole prompt needed."""

    async def scenario() -> None:
        fleet, router = fleet_of_three()
        head = prompt(0, 0)[:256]
        assert not router.holds_all(PromptHashes(head), fleet.ready())
        # Half the head cached on one node: the rest of the prompt cannot change the choice.
        half = block_hashes(head, SCHEME)[:8]
        fleet.backends[URLS[0]].residency = Residency(SCHEME, set(half))
        assert not router.holds_all(PromptHashes(head), fleet.ready())
        # Sent somewhere whole, the head is held there until the feed says otherwise.
        router.choose(PromptHashes(prompt(0, 0)), fleet.ready())
        assert router.holds_all(PromptHashes(head), fleet.ready())
        await fleet.close()

    asyncio.run(scenario())


def with_adapters(fleet: Fleet, served: dict[str, dict[str, bool]]) -> None:
    """url -> {adapter name: loaded}, as the nodes' feeds list them."""
    for url, adapters in served.items():
        fleet.backends[url].adapters = {
            name: Adapter(name=name, path=f"/adapters/{name}", loaded=loaded)
            for name, loaded in adapters.items()
        }


def test_an_adapter_request_goes_only_to_nodes_serving_it() -> None:
    async def scenario() -> None:
        fleet, router = fleet_of_three()
        with_adapters(fleet, {URLS[0]: {"sql": False}, URLS[1]: {"law": False}})
        for question in range(4):
            choice = router.choose(PromptHashes(prompt(0, question)), fleet.ready(), "law")
            assert choice.order == [URLS[1]]
        assert requested_adapter("sql", fleet.ready()) == "sql"
        # The base model, or a name no node lists: the node it goes to answers it.
        assert requested_adapter("base", fleet.ready()) is None
        assert requested_adapter("poetry", fleet.ready()) is None
        await fleet.close()

    asyncio.run(scenario())


def test_adapter_requests_follow_the_adapter_until_an_eviction_shows() -> None:
    async def scenario() -> None:
        fleet, router = fleet_of_three()
        names = {"a0": False, "a1": False, "a2": False}
        with_adapters(fleet, {url: dict(names) for url in URLS})
        # Each adapter, held nowhere, goes to a node holding none yet: one per node.
        first = {
            name: router.choose(PromptHashes(prompt(i, 0)), fleet.ready(), name)
            for i, name in enumerate(names)
        }
        assert {c.reason for c in first.values()} == {Reason.ADAPTER}
        assert sorted(c.order[0] for c in first.values()) == sorted(URLS)
        # Before any feed says it is loaded, another prompt for it follows it there.
        for i, name in enumerate(names):
            again = router.choose(PromptHashes(prompt(10 + i, 0)), fleet.ready(), name)
            assert again.order[0] == first[name].order[0]
            assert again.reason == Reason.ADAPTER
        # The feed lists a0 loaded, then evicted: from then on the feed alone says.
        home = first["a0"].order[0]
        fleet.backends[home].adapters["a0"] = Adapter(name="a0", path="/adapters/a0", loaded=True)
        router.choose(PromptHashes(prompt(20, 0)), fleet.ready(), "a0")
        fleet.backends[home].adapters["a0"] = Adapter(name="a0", path="/adapters/a0", loaded=False)
        other = next(url for url in URLS if url != home)
        fleet.backends[other].adapters["a0"] = Adapter(name="a0", path="/adapters/a0", loaded=True)
        after = router.choose(PromptHashes(prompt(21, 0)), fleet.ready(), "a0")
        assert after.order[0] == other and after.reason == Reason.ADAPTER
        await fleet.close()

    asyncio.run(scenario())
