"""What a forward pass needs to find each token's place in the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch layout, shared by every attention layer.

    Sequence ``i`` owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``; its KV (the new
    tokens included) is ``seq_lens_k[i]`` tokens long and lives in the blocks listed in
    ``block_tables[i]``. ``slot_mapping[t]`` is where token ``t``'s K/V is written
    (``block_id * block_size + offset``; -1 skips the write).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens_k: torch.Tensor  # [num_seqs] int32
    max_seqlen_q: int
    max_seqlen_k: int
