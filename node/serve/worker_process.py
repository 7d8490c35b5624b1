"""A worker process: one tensor-parallel rank's weights and KV cache, executing step plans.

Every rank receives the same plans in the same order from the scheduler and runs the same
forward pass (the ranks meet in all-reduces); only rank 0 samples and answers.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.step_plan import StepPlan
from pagedllm.ipc import sockets
from pagedllm.ipc.messages import ProcessReady, StepRefused, WorkerReady
from pagedllm.models import cpu_linear
from pagedllm.models.tokenizer import load_tokenizer
from pagedllm.runtime.child_process import setup_child
from pagedllm.worker.allocator import fix_mmap_threshold
from pagedllm.worker.model_runner import ModelRunner, resolve_device
from pagedllm.worker.plan_check import plan_problem

log = logging.getLogger(__name__)
# The CPUs the pod may compute on (the operator sets it from the pod's CPU request).
CPUS_ENV = "PAGEDLLM_CPUS"


@dataclass
class WorkerSpec:
    config: EngineConfig
    model_dir: str
    rank: int
    ipc_paths: sockets.IpcPaths
    log_level: str
    supervisor_pid: int
    # Where the tokenizer is (--tokenizer, or the model's own: a GGUF file holds its own), for
    # the grammars of structured outputs.
    tokenizer_dir: str


def torch_threads(tp_size: int) -> int:
    """Compute threads per rank: ``OMP_NUM_THREADS`` when set, else the pod's CPUs
    (``PAGEDLLM_CPUS``, which the operator sets from the pod's CPU request, or the cores this
    process may run on) shared among the ranks."""
    configured = _positive_env("OMP_NUM_THREADS")
    if configured is not None:
        return configured
    cores = _positive_env(CPUS_ENV)
    if cores is None:
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
    return max(1, cores // tp_size)


def _positive_env(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def run_worker(spec: WorkerSpec) -> None:
    setup_child(
        f"worker {spec.rank}", spec.log_level, spec.supervisor_pid, spec.ipc_paths.directory
    )
    # Before any allocation or primitive of the model: a node under steady traffic keeps its size.
    fix_mmap_threshold()
    cpu_linear.bound_caches()
    try:
        _serve(spec)
    except Exception:
        log.exception("worker %d failed", spec.rank)
        sys.exit(1)


def _serve(spec: WorkerSpec) -> None:
    config, rank, tp_size = spec.config, spec.rank, spec.config.tensor_parallel_size
    torch.set_num_threads(torch_threads(tp_size))
    device = resolve_device(config.device)
    if tp_size > 1:
        if device.type == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{spec.ipc_paths.dist_init_file}",
            rank=rank,
            world_size=tp_size,
        )
    runner = ModelRunner(config, spec.model_dir, tp_rank=rank, tp_size=tp_size)
    if rank == 0:
        # Rank 0 samples, so it follows the grammars of constrained requests.
        runner.enable_structured_outputs(load_tokenizer(spec.tokenizer_dir))
    # Kernels built and first-call caches filled now, so that no step of a ready node is
    # slow for a reason its step deadline cannot know.
    runner.warm_up()
    paths = spec.ipc_paths
    ctx = zmq.Context()
    plans = sockets.pull(ctx, paths.plans(rank))
    results = sockets.push(ctx, paths.results) if rank == 0 else None
    vocab_size = runner.model_config.vocab_size
    if results is not None:
        sockets.send(
            results, WorkerReady(rank, runner.num_blocks, runner.max_model_len, vocab_size)
        )
    control = sockets.push(ctx, paths.control)
    sockets.send(control, ProcessReady("worker", rank))
    log.info("ready: %d KV blocks, max_model_len %d", runner.num_blocks, runner.max_model_len)
    where = f"worker {rank}"
    while True:
        plan = sockets.parse(plans.recv(), where)
        if not isinstance(plan, StepPlan):
            if plan is not None:
                log.warning("%s: ignored a %s message", where, type(plan).__name__)
            continue
        problem = runner.load_grammars(plan) or plan_problem(
            plan,
            runner.seqs,
            runner.num_blocks,
            runner.block_size,
            runner.model_config.vocab_size,
            runner.last_samples,
            None if runner.grammars is None else runner.grammars.grammars,
            None if runner.loras is None else runner.loras.held(),
        )
        if problem is not None:
            # Never silently: the scheduler waits for this step and must learn it will not come.
            log.error("%s: refused step plan %d: %s", where, plan.step_id, problem)
            if results is not None:
                sockets.send(results, StepRefused(plan.step_id, problem))
            continue
        result = runner.execute(plan)
        if results is not None:
            sockets.send(results, result)
