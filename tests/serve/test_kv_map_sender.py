"""The scheduler's block-map sender: nothing without a watch, the map to the watching API
server only, at most one per interval, and nothing once the watch lapses."""

from __future__ import annotations

import itertools

import pytest
import zmq

from pagedllm.core.kv_map import KVMap
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.ipc import messages
from pagedllm.ipc.messages import KV_MAP_INTERVAL_S, WATCH_LEASE_S
from pagedllm.sampling_params import SamplingParams
from pagedllm.serve import kv_map_sender
from pagedllm.serve.kv_map_sender import KVMapSender
from pagedllm_testing.fake_worker import FakeWorker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def received(sock: zmq.Socket) -> list[KVMap]:
    maps = []
    while sock.poll(50):
        message = messages.decode(sock.recv())
        assert isinstance(message, KVMap)
        maps.append(message)
    return maps


def test_maps_go_only_to_watchers_at_most_once_per_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(kv_map_sender.time, "monotonic", clock)
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32
        )
    )
    scheduler.add_request("r", [1, 2, 3, 4, 5, 6], SamplingParams(n=2, max_tokens=8), ())
    worker = FakeWorker(vocab=6, eos=0)
    for _ in range(2):
        plan = scheduler.schedule()
        scheduler.update(plan, worker.execute(plan))
    ctx = zmq.Context()
    names = itertools.count()
    pairs = []
    for _ in range(2):
        address = f"inproc://api-{next(names)}"
        pull = ctx.socket(zmq.PULL)
        pull.bind(address)
        push = ctx.socket(zmq.PUSH)
        push.connect(address)
        pairs.append((push, pull))
    sender = KVMapSender(scheduler, [push for push, _ in pairs])
    try:
        sender.publish(scheduler.stats())
        assert received(pairs[0][1]) == [] and received(pairs[1][1]) == []  # nobody watches
        assert not sender.watch(2)  # no such API server
        assert sender.watch(1)
        sender.publish(scheduler.stats())
        (kv_map,) = received(pairs[1][1])
        assert received(pairs[0][1]) == []
        assert kv_map.num_used == scheduler.block_manager.pool.num_used > 0
        assert len(kv_map.seqs) == 2 and kv_map.shared_ids  # the samples share the prompt
        clock.now += KV_MAP_INTERVAL_S / 2
        sender.publish(scheduler.stats())
        assert received(pairs[1][1]) == []  # too soon
        clock.now += KV_MAP_INTERVAL_S
        sender.publish(scheduler.stats())
        assert len(received(pairs[1][1])) == 1
        clock.now += WATCH_LEASE_S
        sender.publish(scheduler.stats())
        assert received(pairs[1][1]) == []  # the watch lapsed
    finally:
        ctx.destroy(linger=0)
