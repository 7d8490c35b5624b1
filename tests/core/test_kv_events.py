"""The prefix cache's recorded events: replayed, they give exactly the pool's hash map."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant

from pagedllm.core.block_manager import block_hash, root_hash
from pagedllm.core.kv_events import (
    CacheEvent,
    KVUpdate,
    apply_update,
    group_updates,
    parents_first,
)
from pagedllm_testing.scheduler_machine import SchedulerMachine


def chain(token_ids: list[int], block_size: int, seed: int = 0) -> dict[bytes, bytes]:
    """hash -> parent of every full block of ``token_ids``, computed here from scratch."""
    parents: dict[bytes, bytes] = {}
    parent = root_hash(seed)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = block_hash(parent, token_ids[start : start + block_size])
        parents[h] = parent
        parent = h
    return parents


class RecordingSchedulerMachine(SchedulerMachine):
    """The scheduler machine's random requests, aborts, forks, beams and evictions, with a
    subscriber's copy of the hash map kept from the recorded events after every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = self.scheduler.block_manager.pool
        self.pool.record_events()
        self.mirror: dict[bytes, bytes] = {}

    @invariant()
    def check_mirror(self) -> None:
        for update in group_updates(self.pool.take_events()):
            apply_update(self.mirror, update)
        assert list(self.mirror) == self.pool.cached_hashes
        truth: dict[bytes, bytes] = {}
        # Blocks are registered only for sequences that were scheduled.
        for seq in self.ran.values():
            truth.update(chain(seq.token_ids, self.scheduler.config.block_size))
        assert self.mirror == {h: truth[h] for h in self.mirror}

    def teardown(self) -> None:
        super().teardown()
        self.check_mirror()


TestRecordingSchedulerMachine = RecordingSchedulerMachine.TestCase
TestRecordingSchedulerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)


def _h(i: int) -> bytes:
    return i.to_bytes(16, "little")


@st.composite
def event_runs(draw: st.DrawFn) -> tuple[dict[bytes, bytes], list[CacheEvent]]:
    """A hash map and a run of changes to it that are possible from there: a hash enters only
    when absent and leaves only when present."""
    present = set(draw(st.sets(st.integers(0, 7), max_size=8)))
    start = {_h(i): _h(100 + i) for i in sorted(present)}
    events: list[CacheEvent] = []
    for i in draw(st.lists(st.integers(0, 7), max_size=40)):
        if i in present:
            present.discard(i)
            events.append((_h(i), None))
        else:
            present.add(i)
            events.append((_h(i), _h(100 + i)))
    return start, events


@settings(max_examples=300, deadline=None)
@given(run=event_runs())
def test_grouped_updates_applied_removed_first_give_the_events_in_order(
    run: tuple[dict[bytes, bytes], list[CacheEvent]],
) -> None:
    start, events = run
    expected = dict(start)
    for h, parent in events:
        if parent is None:
            del expected[h]
        else:
            expected[h] = parent
    replayed = dict(start)
    updates = group_updates(events)
    for update in updates:
        apply_update(replayed, update)
    assert replayed == expected
    assert sum(len(u.stored) + len(u.removed) for u in updates) == len(events)
    assert all(u.stored or u.removed for u in updates)


def test_a_hash_stored_then_removed_in_one_batch_takes_two_updates() -> None:
    a, b, root = _h(1), _h(2), _h(0)
    updates = group_updates([(a, root), (b, a), (a, None)])
    assert updates == [KVUpdate(stored=[(a, root), (b, a)]), KVUpdate(removed=[a])]
    # Removed then stored again is one update: removed first is its order.
    assert group_updates([(a, None), (a, root)]) == [KVUpdate(stored=[(a, root)], removed=[a])]
    assert group_updates([]) == []


def test_parents_first_moves_a_parent_that_came_back_before_its_children() -> None:
    root, a, b, c, orphan = _h(0), _h(1), _h(2), _h(3), _h(4)
    # a left the map and came back after its children b and c were stored.
    blocks = {b: a, c: b, orphan: _h(99), a: root}
    assert parents_first(blocks) == [(a, root), (b, a), (c, b), (orphan, _h(99))]
    assert parents_first({}) == []


@settings(max_examples=200, deadline=None)
@given(edges=st.lists(st.integers(0, 30), max_size=30), order=st.randoms())
def test_parents_first_keeps_every_block_and_orders_parents_before_children(
    edges: list[int], order: object
) -> None:
    # Block i's parent is block edges[i] when that is lower (a forest), else an absent hash.
    blocks = {_h(i): _h(p) if p < i else _h(1000 + i) for i, p in enumerate(edges)}
    keys = list(blocks)
    order.shuffle(keys)  # type: ignore[attr-defined]
    shuffled = {k: blocks[k] for k in keys}
    ordered = parents_first(shuffled)
    assert dict(ordered) == blocks and len(ordered) == len(blocks)
    position = {h: i for i, (h, _) in enumerate(ordered)}
    for h, parent in ordered:
        if parent in position:
            assert position[parent] < position[h]


def test_update_refuses_hashes_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        KVUpdate(stored=[(_h(1), b"short")])
    with pytest.raises(ValueError, match="16 bytes"):
        KVUpdate(removed=[b""])
