"""Logits of tiny models of each architecture, from transformers and from our paged model
run on a fixed schedule of chunked prefills and decodes, and their comparison."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import (
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagedllm.kernels import reference
from pagedllm.models.attention_metadata import AttentionMetadata
from pagedllm.models.llama import CausalLM
from pagedllm.models.loader import load_model

VOCAB = 128


TOLERANCE = 1e-4


TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


CASES: dict[str, PretrainedConfig] = {
    "llama-gqa": LlamaConfig(**TINY),
    "llama-mqa-tied": LlamaConfig(**{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=True),
    "llama-biases": LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
    "llama-rope-linear": LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-rope-llama3": LlamaConfig(
        **TINY,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "mistral-sliding-window": MistralConfig(**TINY, sliding_window=5),
    "qwen2-bias-tied": Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen2-sliding-upper-layers": Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=4, max_window_layers=1
    ),
    "qwen3-qk-norm": Qwen3Config(**TINY, head_dim=32),
}


# Two sequences: (prompt length, decode steps). Sequence 1's prompt is prefilled in two chunks,
# the second alongside sequence 0's first decode step.
PROMPT_LENS = (11, 9)


SCHEDULE: list[dict[int, int]] = [
    {0: 11, 1: 5},
    {0: 1, 1: 4},
    {0: 1, 1: 1},
    {0: 1, 1: 1},
    {1: 1},
]


SEQUENCE_LENS = tuple(sum(step.get(seq, 0) for step in SCHEDULE) for seq in range(2))


def token_sequences(seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=generator) for length in SEQUENCE_LENS]


def hf_logits(model, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(tokens[None]).logits[0].float() for tokens in sequences]


@dataclass
class PagedSequence:
    tokens: torch.Tensor
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0


@dataclass
class PagedRun:
    """Drives a model step by step through a paged cache, as the engine would."""

    model: CausalLM
    block_size: int
    num_blocks: int = 16
    seed: int = 2
    cache_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        config = self.model.config
        shape = (
            self.num_blocks,
            self.block_size,
            config.num_kv_heads_per_rank(self.model.tp_size),
            reference.cache_row_size(config.head_dim, self.cache_dtype),
        )
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.cache_dtype), torch.zeros(shape, dtype=self.cache_dtype))
            for _ in range(config.num_hidden_layers)
        ]
        generator = torch.Generator().manual_seed(self.seed)
        self.free_blocks = torch.randperm(self.num_blocks, generator=generator).tolist()

    def step(
        self, sequences: list[PagedSequence], chunks: dict[int, int]
    ) -> dict[int, torch.Tensor]:
        """Run ``chunks[i]`` new tokens of each listed sequence; their logits, by sequence."""
        ids, positions, slots, tables, cu_seqlens, seq_lens = [], [], [], [], [0], []
        for index, count in chunks.items():
            seq = sequences[index]
            start, end = seq.num_computed, seq.num_computed + count
            while len(seq.block_table) * self.block_size < end:
                seq.block_table.append(self.free_blocks.pop())
            new_positions = torch.arange(start, end)
            table = torch.tensor(seq.block_table)
            ids.append(seq.tokens[start:end])
            positions.append(new_positions)
            slots.append(
                table[new_positions // self.block_size] * self.block_size
                + new_positions % self.block_size
            )
            tables.append(seq.block_table)
            cu_seqlens.append(cu_seqlens[-1] + count)
            seq_lens.append(end)
            seq.num_computed = end
        width = max(len(table) for table in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).long(),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]).int(),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32),
            seq_lens_k=torch.tensor(seq_lens, dtype=torch.int32),
            max_seqlen_q=max(chunks.values()),
            max_seqlen_k=max(seq_lens),
        )
        with torch.no_grad():
            hidden = self.model(torch.cat(ids), torch.cat(positions), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        return {index: logits[cu_seqlens[n] : cu_seqlens[n + 1]] for n, index in enumerate(chunks)}


def paged_run(
    model: CausalLM,
    tokens: list[torch.Tensor],
    block_size: int,
    cache_dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], PagedRun]:
    """Each sequence's logits over the schedule, and the run (its KV caches)."""
    run = PagedRun(model, block_size, cache_dtype=cache_dtype)
    sequences = [PagedSequence(t) for t in tokens]
    outputs: list[list[torch.Tensor]] = [[] for _ in tokens]
    for chunks in SCHEDULE:
        for index, logits in run.step(sequences, chunks).items():
            outputs[index].append(logits)
    return [torch.cat(chunks) for chunks in outputs], run


def paged_logits(
    model: CausalLM, tokens: list[torch.Tensor], block_size: int
) -> list[torch.Tensor]:
    return paged_run(model, tokens, block_size)[0]


def assert_logits_match(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for ours_seq, theirs_seq in zip(ours, theirs, strict=True):
        assert ours_seq.dtype == torch.float32
        assert ours_seq.shape == theirs_seq.shape
        assert (ours_seq - theirs_seq).abs().max().item() < TOLERANCE


def tensor_parallel_worker(
    rank: int, world_size: int, port: int, model_dir: Path, model_file: Path | None = None
) -> None:
    """Rank ``rank``'s logits of ``model_file`` (default: the model in ``model_dir``), saved in
    ``model_dir``."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        torch.set_num_threads(1)
        model, _ = load_model(
            model_file or model_dir, ops=reference, tp_rank=rank, tp_size=world_size
        )
        logits = paged_logits(model, token_sequences(), block_size=4)
        torch.save(logits, model_dir / f"logits-rank{rank}.pt")
    finally:
        dist.destroy_process_group()
