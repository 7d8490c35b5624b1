"""The routing policies, as pure functions of what each node holds and how busy it is."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm.router.policy import (
    Candidate,
    Policy,
    Reason,
    bounded_load,
    capacity,
    choose,
    placement_key,
)

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"
KEY = placement_key(list(range(200)))


def nodes(*specs: tuple[str, int, int]) -> list[Candidate]:
    """(url, cached tokens, load): every request in flight there is of this prompt."""
    return [Candidate(url, cached, load, prompt_load=load) for url, cached, load in specs]


def test_the_longest_cached_prefix_wins_within_the_bound() -> None:
    choice = choose(Policy.PREFIX, nodes((A, 32, 2), (B, 512, 2), (C, 0, 1)), KEY, 1.25, 0)
    assert choice.order[0] == B and choice.reason == Reason.PREFIX
    assert choice.cached_tokens == 512
    # The others follow, most cached first: the order a refused request is retried in.
    assert choice.order == [B, A, C]


def test_a_node_above_the_bound_is_passed_over_for_the_least_loaded() -> None:
    # Loads 9, 1, 2: the mean with the new request is 13/3, the bound 1.25 x that: 5.4 -> 6.
    assert capacity([9, 1, 2], 1.25) == 6
    choice = choose(Policy.PREFIX, nodes((A, 1024, 9), (B, 0, 1), (C, 0, 2)), KEY, 1.25, 0)
    assert choice.order[0] == B and choice.reason == Reason.LOAD
    # A looser bound lets the cache win again.
    loose = choose(Policy.PREFIX, nodes((A, 1024, 9), (B, 0, 1), (C, 0, 2)), KEY, 3.0, 0)
    assert loose.order[0] == A and loose.reason == Reason.PREFIX


def test_a_node_over_the_bound_keeps_a_prompt_whose_own_requests_are_within_it() -> None:
    """Loads 9, 1, 2 (bound 6): A is over the bound with other prompts' requests; this
    prompt's 2 there are within it, so it stays where it is cached rather than be prefilled on
    a node whose cache holds other prompts."""
    mixed = [Candidate(A, 1024, 9, prompt_load=2), Candidate(B, 0, 1), Candidate(C, 0, 2)]
    assert bounded_load(mixed[0]) == 2
    choice = choose(Policy.PREFIX, mixed, KEY, 1.25, 0)
    assert choice.order[0] == A and choice.reason == Reason.PREFIX
    # Once this prompt alone is at the bound there, it overflows to the least-loaded node.
    hot = [Candidate(A, 1024, 9, prompt_load=6), Candidate(B, 0, 1), Candidate(C, 0, 2)]
    choice = choose(Policy.PREFIX, hot, KEY, 1.25, 0)
    assert choice.order[0] == B and choice.reason == Reason.LOAD
    # A node that does not cache the prompt is bounded by all of its load.
    cold = [Candidate(A, 0, 9, prompt_load=2), Candidate(B, 0, 1), Candidate(C, 0, 2)]
    assert bounded_load(cold[0]) == 9
    assert choose(Policy.PREFIX, cold, KEY, 1.25, 0).order[0] != A


def test_a_shorter_prefix_within_the_bound_beats_the_overloaded_longest() -> None:
    choice = choose(Policy.PREFIX, nodes((A, 1024, 9), (B, 64, 1), (C, 0, 1)), KEY, 1.25, 0)
    assert choice.order[0] == B and choice.reason == Reason.PREFIX


def test_a_prompt_cached_nowhere_is_placed_by_its_leading_tokens() -> None:
    candidates = nodes((A, 0, 0), (B, 0, 0), (C, 0, 0))
    keys = [placement_key([7] * 130 + [i]) for i in range(20)]  # same first 128 tokens
    placed = {choose(Policy.PREFIX, candidates, k, 1.25, i).order[0] for i, k in enumerate(keys)}
    assert len(placed) == 1
    assert choose(Policy.PREFIX, candidates, keys[0], 1.25, 0).reason == Reason.FALLBACK
    # Different system prompts spread over the nodes.
    spread = Counter(
        choose(Policy.PREFIX, candidates, placement_key([i] * 128), 1.25, 0).order[0]
        for i in range(300)
    )
    assert set(spread) == {A, B, C} and min(spread.values()) > 50
    # A placement that would overload its node goes to one within the bound.
    busy = {choose(Policy.PREFIX, candidates, keys[0], 1.25, 0).order[0]}
    loaded = [Candidate(c.url, 0, 5 if c.url in busy else 0) for c in candidates]
    assert choose(Policy.PREFIX, loaded, keys[0], 1.25, 0).order[0] not in busy


def test_placement_is_stable_when_a_node_leaves() -> None:
    """Rendezvous hashing: removing a node moves only the prompts it held."""
    all_three = nodes((A, 0, 0), (B, 0, 0), (C, 0, 0))
    without_c = nodes((A, 0, 0), (B, 0, 0))
    for i in range(200):
        key = placement_key([i] * 128)
        before = choose(Policy.PREFIX, all_three, key, 1.25, 0).order[0]
        after = choose(Policy.PREFIX, without_c, key, 1.25, 0).order[0]
        if before != C:
            assert after == before


def test_round_robin_cycles_through_every_node() -> None:
    candidates = nodes((C, 999, 0), (A, 0, 0), (B, 0, 50))
    firsts = [choose(Policy.ROUND_ROBIN, candidates, KEY, 1.25, t).order[0] for t in range(6)]
    assert firsts == [A, B, C, A, B, C]
    assert choose(Policy.ROUND_ROBIN, candidates, KEY, 1.25, 0).reason == Reason.ROUND_ROBIN


def test_least_load_ignores_the_caches() -> None:
    choice = choose(Policy.LEAST_LOAD, nodes((A, 2048, 3), (B, 0, 1), (C, 0, 2)), KEY, 1.25, 0)
    assert choice.order[0] == B and choice.reason == Reason.LOAD


def test_random_takes_the_drawn_node() -> None:
    candidates = nodes((A, 0, 0), (B, 0, 0), (C, 0, 0))
    assert [choose(Policy.RANDOM, candidates, KEY, 1.25, t).order[0] for t in (0, 1, 2)] == [
        A,
        B,
        C,
    ]


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose(Policy.PREFIX, [], KEY, 1.25, 0)


@given(
    loads=st.lists(st.integers(0, 50), min_size=1, max_size=8),
    cached=st.lists(st.integers(0, 4).map(lambda b: 16 * b), min_size=8, max_size=8),
    mine=st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8),
    bound=st.floats(1.0, 4.0),
)
def test_prefix_never_picks_a_node_over_the_bound_for_its_prompt(
    loads: list[int], cached: list[int], mine: list[float], bound: float
) -> None:
    """``mine``: the share of each node's load that is this prompt's."""
    candidates = [
        Candidate(f"http://n{i}", cached[i], load, prompt_load=round(mine[i] * load))
        for i, load in enumerate(loads)
    ]
    choice = choose(Policy.PREFIX, candidates, KEY, bound, 0)
    chosen = next(c for c in candidates if c.url == choice.order[0])
    cap = capacity(loads, bound)

    def eligible(c: Candidate) -> bool:
        return bounded_load(c) + 1 <= cap

    assert eligible(chosen)
    assert sorted(choice.order) == sorted(c.url for c in candidates)
    # Among the eligible, nothing holds more of the prompt than the chosen node.
    if choice.reason == Reason.PREFIX:
        best = max(c.cached_tokens for c in candidates if eligible(c))
        assert chosen.cached_tokens == best > 0


def test_prompts_cached_nowhere_spread_by_placements_so_far() -> None:
    candidates = [Candidate(A, 0, 0, placed=2), Candidate(B, 0, 0, placed=1), Candidate(C, 0, 0, 1)]
    for i in range(20):
        choice = choose(Policy.PREFIX, candidates, placement_key([i] * 128), 1.25, 0)
        assert choice.order[0] in (B, C) and choice.reason == Reason.FALLBACK


def adapter_nodes(*specs: tuple[str, int, int, bool, int]) -> list[Candidate]:
    """(url, cached tokens, load, adapter loaded there, adapters loaded there)."""
    return [
        Candidate(url, cached, load, prompt_load=load, adapter_loaded=held, adapters_loaded=n)
        for url, cached, load, held, n in specs
    ]


@pytest.mark.parametrize(
    ("specs", "chosen", "reason"),
    [
        # Held by B only: B, though C is less loaded.
        (((A, 0, 2, False, 1), (B, 0, 2, True, 2), (C, 0, 1, False, 0)), B, Reason.ADAPTER),
        # Among nodes holding it, the longest cached prefix wins, as a prefix hit.
        (((A, 64, 1, True, 1), (B, 0, 1, True, 2), (C, 0, 0, False, 0)), A, Reason.PREFIX),
        # Loads 9, 1, 2 bound a node at 6: A's copy is passed over, and the adapter, held
        # nowhere within the bound, goes where the LRU has room (fewest adapters loaded).
        (((A, 0, 9, True, 2), (B, 0, 1, False, 2), (C, 0, 2, False, 0)), C, Reason.ADAPTER),
        (((A, 0, 0, False, 2), (B, 0, 0, False, 1), (C, 0, 0, False, 2)), B, Reason.ADAPTER),
    ],
)
def test_an_adapter_request_goes_where_its_adapter_is_loaded_within_the_bound(
    specs: tuple[tuple[str, int, int, bool, int], ...], chosen: str, reason: Reason
) -> None:
    key = placement_key(list(range(200)), "sql")
    assert key != KEY  # the same tokens for another adapter are another prompt
    choice = choose(Policy.PREFIX, adapter_nodes(*specs), key, 1.25, 0, adapter=True)
    assert choice.order[0] == chosen and choice.reason == reason


def test_random_placement_ignores_the_adapters() -> None:
    key = placement_key([1, 2, 3], "sql")
    held = adapter_nodes((A, 0, 0, True, 1), (B, 0, 0, False, 0), (C, 0, 0, False, 0))
    picks = {
        choose(Policy.RANDOM, held, key, 1.25, turn, adapter=True).order[0] for turn in range(3)
    }
    assert picks == {A, B, C}
