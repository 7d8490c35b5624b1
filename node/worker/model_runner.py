"""A worker's side of a step: apply the plan, run the model over the paged cache, sample."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.step_plan import (
    LAST_SAMPLE,
    NewSequence,
    PromptLogprobs,
    RunningUpdate,
    SamplingSpec,
    SeqSample,
    StepPlan,
    StepResult,
)
from pagedllm.kernels import kernel_ops
from pagedllm.lora.manager import LoRAManager
from pagedllm.models import decode_graph
from pagedllm.models.attention_metadata import AttentionMetadata
from pagedllm.models.loader import load_model
from pagedllm.worker import kv_cache
from pagedllm.worker.sampler import SampleRow, sample
from pagedllm.worker.spec_verify import verify
from pagedllm.worker.step_batch import PromptRows, StepBatch, Verifying, prepare_batch

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pagedllm.structured.matchers import GrammarMatchers, TokenMask

log = logging.getLogger(__name__)
# Ids of the warm-up's sequence and step: the scheduler's count up from 0.
WARM_UP_SEQ = -1
WARM_UP_STEP = -1


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    """Holds one tensor-parallel rank's weights and KV cache and executes step plans."""

    def __init__(
        self, config: EngineConfig, model_dir: str, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        self.config = config
        self.tp_rank = tp_rank
        self.device = resolve_device(config.device)
        self.ops = kernel_ops(config.kernel_backend, self.device)
        self.model, self.model_config = load_model(
            model_dir,
            dtype=config.dtype,
            quantization=config.quantization,
            device=self.device,
            ops=self.ops,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.dtype = next(self.model.parameters()).dtype
        self.cache_dtype = kv_cache.cache_dtype(config.kv_cache_dtype, self.dtype)
        if self.cache_dtype == torch.int8 and (
            self.device.type != "cpu" or config.kernel_backend == "triton"
        ):
            raise ValueError(
                "kv_cache_dtype int8_per_token_head is read by the CPU kernels only; on CUDA "
                "use fp8 (fp8_e4m3) or fp8_e5m2"
            )
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={mc.max_position_embeddings}"
            )
        self.num_kv_heads = mc.num_kv_heads_per_rank(tp_size)
        self.block_size = config.block_size
        self.num_blocks, memory = self._size_cache()
        kv_cache.check_fits(self.num_blocks, self.block_size, self.max_model_len, memory)
        self.kv_caches = kv_cache.allocate(
            mc.num_hidden_layers,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            mc.head_dim,
            self.cache_dtype,
            self.device,
        )
        self.loras: LoRAManager | None = None
        if config.enable_lora:
            assert config.max_cpu_loras is not None  # EngineConfig fills it in
            self.loras = LoRAManager(
                self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras
            )
        if not config.enforce_eager and self.loras is None:
            # vLLM's CPU backend runs eager under LoRA too: adapters add to every matmul.
            self.model.model.decode_graph = decode_graph.build(self.model.model)
        log.info(
            "decode steps: %s",
            "eager" if self.model.model.decode_graph is None else "one call (decode graph)",
        )
        self.seqs: dict[int, NewSequence] = {}
        # seq id -> the (first) token sampled for it in the last step that sampled it
        self.last_samples: dict[int, int] = {}
        # The matchers of constrained sequences (rank 0, once enabled).
        self.grammars: GrammarMatchers | None = None
        log.info(
            "KV cache: %d blocks of %d tokens (%d bytes)", self.num_blocks, self.block_size, memory
        )

    def _block_bytes(self) -> int:
        mc = self.model_config
        return kv_cache.block_bytes(
            mc.num_hidden_layers, self.block_size, self.num_kv_heads, mc.head_dim, self.cache_dtype
        )

    def _size_cache(self) -> tuple[int, int]:
        per_block = self._block_bytes()
        if self.config.kv_cache_memory is not None:
            memory = self.config.kv_cache_memory
        elif self.device.type == "cuda":
            memory = self._profile_cuda_free_memory()
        else:
            memory = kv_cache.default_cpu_kv_memory()
        return memory // per_block, memory

    def _profile_cuda_free_memory(self) -> int:
        """Run a forward of the largest batch, then give what is left to the cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-tokens // self.block_size)
        mc = self.model_config
        scratch = kv_cache.allocate(
            mc.num_hidden_layers,
            blocks,
            self.block_size,
            self.num_kv_heads,
            mc.head_dim,
            self.cache_dtype,
            self.device,
        )
        positions = torch.arange(tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            seq_lens_k=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            max_seqlen_q=tokens,
            max_seqlen_k=tokens,
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.zeros(tokens, dtype=torch.long, device=self.device), positions, scratch, meta
            )
            self.model.compute_logits(hidden[-min(tokens, self.config.max_num_seqs) :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.gpu_memory_utilization) - peak
        if budget <= 0:
            raise ValueError(
                f"no memory left for the KV cache: weights and activations take {peak} bytes "
                f"of {total}; raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return budget

    def enable_structured_outputs(self, tokenizer: Any) -> None:
        """Follow grammars from now on (rank 0, which samples); xgrammar is imported here, so
        that a runner never asked to is spared it."""
        from pagedllm.structured.compiler import tokenizer_info
        from pagedllm.structured.matchers import GrammarMatchers

        mc = self.model_config
        self.grammars = GrammarMatchers(tokenizer_info(tokenizer, mc.vocab_size, mc.eos_token_ids))

    def load_grammars(self, plan: StepPlan) -> str | None:
        """Take in the grammars ``plan`` brings (before checking it: its sequences need them);
        what is wrong with one, or None."""
        if self.grammars is None:
            return None
        return self.grammars.load(plan.grammars)

    # ----- executing a plan ----------------------------------------------------------------

    def warm_up(self) -> None:
        """A three-token prefill and one decode step of a sequence no scheduler uses, then
        forgotten: the attention kernels are built or loaded and every first-call cost is
        paid before the worker reports ready. Its KV slots are overwritten before any later
        sequence reads them."""
        prompt = [0, 1, 2]
        blocks = list(range(-(-(len(prompt) + 1) // self.block_size)))
        greedy = SamplingSpec(temperature=0.0)
        new = NewSequence(WARM_UP_SEQ, prompt, len(prompt), blocks, 0, 0, greedy)
        self.execute(StepPlan(WARM_UP_STEP, new=[new], scheduled=[(WARM_UP_SEQ, len(prompt))]))
        # An explicit token, not LAST_SAMPLE: only rank 0 samples.
        decode = RunningUpdate(WARM_UP_SEQ, [0], len(blocks), [], len(prompt))
        self.execute(StepPlan(WARM_UP_STEP, running=[decode], scheduled=[(WARM_UP_SEQ, 1)]))
        self.execute(StepPlan(WARM_UP_STEP, finished=[WARM_UP_SEQ]))

    def _apply(self, plan: StepPlan) -> None:
        for seq_id in plan.finished:
            self.seqs.pop(seq_id, None)
            self.last_samples.pop(seq_id, None)
        if self.grammars is not None:
            self.grammars.forget(plan.finished)
            problem = self.load_grammars(plan)
            if problem is not None:
                raise ValueError(problem)
            self.grammars.drop_grammars(plan.dropped_grammars)
        for new in plan.new:
            # The worker's own copy: later plans only send what changes.
            self.seqs[new.seq_id] = dataclasses.replace(
                new, token_ids=list(new.token_ids), block_ids=list(new.block_ids)
            )
        for update in plan.running:
            seq = self.seqs[update.seq_id]
            seq.token_ids.extend(
                self.last_samples[update.seq_id] if t == LAST_SAMPLE else t
                for t in update.new_token_ids
            )
            del seq.block_ids[update.blocks_from :]
            seq.block_ids.extend(update.block_ids)
            seq.num_computed_tokens = update.num_computed_tokens
        if plan.block_copies:
            pairs = torch.tensor(plan.block_copies, dtype=torch.long, device=self.device)
            self.ops.copy_blocks(self.kv_caches, pairs)
        if self.loras is not None:
            self.loras.follow(plan.lora_drops, plan.lora_loads)
            tokens = [(self.seqs[seq_id].lora, n) for seq_id, n in plan.scheduled]
            self.loras.prepare(tokens, self.device)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """One step: the plan applied, its batch laid out and run through the model, and on
        rank 0 (which samples) the samples, the verified drafts and the prompt logprobs."""
        self._apply(plan)
        result = StepResult(step_id=plan.step_id)
        if not plan.scheduled:
            return result
        batch = prepare_batch(plan, self.seqs, self.block_size)
        meta = self._attention_metadata(batch)
        # The grammars' mask is filled while the model runs.
        mask_ahead = (
            None
            if self.grammars is None or not batch.sampled
            else self.grammars.mask_ahead(batch.sampled)
        )
        hidden = self._forward(batch, meta)
        if self.tp_rank != 0:
            return result
        if batch.sample_rows:
            self._sample(plan, batch, hidden, mask_ahead, result)
        if batch.verifying:
            self._verify(hidden, batch.verifying, result)
        self._add_prompt_logprobs(hidden, batch.prompt_rows, result)
        return result

    def _attention_metadata(self, batch: StepBatch) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(batch.slots)).to(dev),
            block_tables=torch.from_numpy(batch.block_table()).to(dev),
            cu_seqlens_q=torch.tensor(batch.cu_seqlens, dtype=torch.int32, device=dev),
            seq_lens_k=torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev),
            max_seqlen_q=int(np.diff(batch.cu_seqlens).max()),
            max_seqlen_k=max(batch.seq_lens),
        )

    def _forward(self, batch: StepBatch, meta: AttentionMetadata) -> torch.Tensor:
        """The last hidden states of every row of the batch."""
        return self.model(
            torch.from_numpy(np.concatenate(batch.input_ids)).to(self.device),
            torch.from_numpy(np.concatenate(batch.positions)).to(self.device),
            self.kv_caches,
            meta,
        )

    def _sample(
        self,
        plan: StepPlan,
        batch: StepBatch,
        hidden: torch.Tensor,
        mask_ahead: Future[TokenMask | None] | None,
        result: StepResult,
    ) -> None:
        logits = self.model.compute_logits(
            hidden[torch.tensor(batch.sample_rows, device=self.device)]
        )
        # Waited for only now: the mask is filled while the logits are computed too.
        mask = None if mask_ahead is None else mask_ahead.result()
        rows = [
            SampleRow(
                seq.sampling,
                seq.token_ids[: seq.prompt_len],
                seq.token_ids[seq.prompt_len :],
                plan.num_samples.get(seq_id, 1),
            )
            for seq_id, seq in batch.sampled
        ]
        for (seq_id, _), out in zip(batch.sampled, sample(logits, rows, mask), strict=True):
            self.last_samples[seq_id] = out.token_ids[0]
            result.samples.append(SeqSample(seq_id, out.token_ids, out.logprobs, out.top_logprobs))

    def _add_prompt_logprobs(
        self, hidden: torch.Tensor, prompt_rows: list[PromptRows], result: StepResult
    ) -> None:
        for rows in prompt_rows:
            logits = self.model.compute_logits(hidden[rows.row : rows.row + rows.count])
            result.prompt_logprobs.append(_prompt_logprobs(rows, logits))

    def _verify(self, hidden: torch.Tensor, verifying: list[Verifying], result: StepResult) -> None:
        rows = [r for v in verifying for r in range(v.first_row, v.first_row + len(v.draft) + 1)]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        at = 0
        for v in verifying:
            seq = v.seq
            out = verify(
                logits[at : at + len(v.draft) + 1],
                seq.sampling,
                seq.token_ids[: seq.prompt_len],
                seq.token_ids[seq.prompt_len :],
                v.draft,
            )
            at += len(v.draft) + 1
            self.last_samples[v.seq_id] = out.token_ids[-1]
            result.samples.append(
                SeqSample(v.seq_id, out.token_ids, out.logprobs, out.top_logprobs)
            )


def _prompt_logprobs(rows: PromptRows, logits: torch.Tensor) -> PromptLogprobs:
    """Log probabilities of the prompt tokens after positions ``start .. start + len - 1``
    (``logits``: those of ``rows``)."""
    seq_id, seq, start = rows.seq_id, rows.seq, rows.start
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    count = logits.shape[0]
    targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + count], device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in range(count)]
    k = seq.sampling.prompt_logprobs or 0
    if k > 0:
        top = torch.topk(logprobs, k)
        tops = [
            list(zip(ids, vals, strict=True))
            for ids, vals in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        ]
    return PromptLogprobs(seq_id, start + 1, chosen, tops)
