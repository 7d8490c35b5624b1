"""The engine in one process: scheduler, model runner and output processing in a loop."""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig, resolve_model_dir, scheduler_config
from pagedllm.core.lora_request import LoRARequest
from pagedllm.core.reporting import SchedulerStats
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import GrammarRef
from pagedllm.models.tokenizer import load_tokenizer
from pagedllm.output.bad_words import bad_words_token_ids
from pagedllm.output.processor import RequestOutputState
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner


@dataclass
class StepTiming:
    """Where one step's time went, for the engine statistics."""

    schedule_s: float
    execute_s: float
    num_tokens: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError(
                "the in-process engine runs one rank; use `pagedllm serve "
                "--tensor-parallel-size N` for tensor parallelism"
            )
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir)
        self.runner = ModelRunner(config, self.model_dir)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = tuple(self.runner.model_config.eos_token_ids)
        self.scheduler = Scheduler(
            scheduler_config(config, self.runner.num_blocks, self.max_model_len)
        )
        self._states: dict[str, RequestOutputState] = {}
        self._ids = itertools.count()
        self.last_step: StepTiming | None = None
        self._grammar_compiler: Any = None

    def tokenize(self, prompt: str | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            vocab = self.runner.model_config.vocab_size
            if not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(
                    f"prompt_token_ids must be a non-empty list of ids in [0, {vocab})"
                )
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        raise ValueError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {prompt!r}")

    def add_request(
        self,
        prompt: str | dict[str, Any],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        text, ids = self.tokenize(prompt)
        if lora_request is not None:
            if self.runner.loras is None:
                raise ValueError(
                    f"LoRA adapter {lora_request.lora_name!r} asked for, but the engine was "
                    "started without enable_lora=True"
                )
            self.runner.loras.check(lora_request)  # now, not in the middle of a step
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        grammar = self._compile(params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._states[request_id] = RequestOutputState(
            request_id, text, ids, params, self.tokenizer, arrival
        )
        self.scheduler.add_request(
            request_id, ids, params, self.eos_token_ids, arrival, grammar, lora_request
        )
        return request_id

    def _compile(self, params: SamplingParams) -> GrammarRef | None:
        """The request's grammar, compiled (or from the cache) before it is queued; a
        constraint that cannot compile raises ``ValueError``. xgrammar is loaded by the first
        constrained request."""
        if params.structured_outputs is None:
            return None
        if self._grammar_compiler is None:
            from pagedllm.structured.compiler import GrammarCompiler, tokenizer_info

            mc = self.runner.model_config
            self._grammar_compiler = GrammarCompiler(
                tokenizer_info(self.tokenizer, mc.vocab_size, list(self.eos_token_ids))
            )
            self.runner.enable_structured_outputs(self.tokenizer)
        grammar: GrammarRef = self._grammar_compiler.compile(params.structured_outputs)
        return grammar

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states) or self.scheduler.has_work()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, and report every request that moved."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = self.runner.execute(plan)
        t2 = time.perf_counter()
        self.last_step = StepTiming(t1 - t0, t2 - t1, plan.num_tokens)
        outputs: list[RequestOutput] = []
        for delta in self.scheduler.update(plan, result):
            state = self._states.get(delta.request_id)
            if state is None:
                continue
            state.apply(delta, functools.partial(self.scheduler.stop_sequence, delta.request_id))
            outputs.append(state.output())
            if state.finished:
                del self._states[delta.request_id]
        return outputs
