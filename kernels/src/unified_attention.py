"""Paged attention over a mixed batch of prefill chunks and decode tokens, in Triton.

One program attends one tile of a sequence's queries with one KV head. The rows of its Q tile
are (query, query head) pairs covering every query head of that KV head's group, so each K/V
tile is read once for the whole group. The program walks the sequence's keys in tiles of
``keys`` tokens, finding each token's slot through the block table, and keeps an online
softmax in fp32 (in base 2: scores are pre-multiplied by log2(e)).

An 8-bit float cache (``float8_e4m3fn``, ``float8_e5m2``) is read in place: each K/V tile is
loaded as 8-bit floats and widened in registers to the queries' dtype, which holds every 8-bit
value exactly, so the dots multiply the values the reference widens to fp32 and accumulate in
fp32, as with a 16-bit cache; the tiles are those of the queries' dtype, adjusted where the
8-bit tiles beside their widened copies need more registers (``tile_shape``).

When there are too few (sequence, KV head) programs to fill the GPU, each program's key range
is split (flash-decoding): every split writes its running max, sum and unnormalised output to
fp32 scratch and a second kernel merges the splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedllm.kernels.reference import FLOAT8
from pagedllm.kernels.triton_device import compute_capability, is_interpreting, tl, triton

# The smallest tile tl.dot accepts on NVIDIA GPUs.
MIN_DOT_SIZE = 16

MIN_KEYS_PER_SPLIT = 512
MAX_KV_SPLITS = 32

# Where the compute capability is unknown (the interpreter) the tiles are chosen as for sm_90.
DEFAULT_CAPABILITY = (9, 0)

FP8_DTYPES = FLOAT8
# Triton has float8_e4m3fn (its fp8e4nv) from sm_89 on, float8_e5m2 on every target.
FP8_E4M3_MIN_CAPABILITY = (8, 9)

_TRITON_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclass(frozen=True)
class AttentionTiles:
    query_rows: int  # (query, head) rows of a program's Q tile
    queries: int  # queries per program: query_rows // group
    keys: int  # keys per step of the KV walk
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class TileShape:
    query_rows: int  # (query, head) rows; more when a GQA group alone has more heads
    keys: int
    num_warps: int
    num_stages: int


def tile_shape(
    head_dim_padded: int,
    element_size: int,
    decode: bool,
    capability: tuple[int, int],
    fp8_cache: bool = False,
) -> TileShape:
    """The largest tiles that keep a program's accumulator, Q tile and scores in registers
    and its pipelined K/V stages in shared memory, without spilling, on this target.

    Chosen from ``bench/kernels_aot.py``'s table (registers, spills and shared memory of every
    configuration compiled for sm_80, sm_86, sm_89 and sm_90); see docs/design/kernels.md.
    ``element_size`` is that of the dots' operands: with an 8-bit cache (``fp8_cache``), the
    queries' dtype, its K/V tiles widened to it in registers beside the 8-bit ones loaded.
    """
    head_bytes = head_dim_padded * element_size
    if element_size == 4:
        # fp32 multiplies on CUDA cores (no tensor cores), operands and products held per
        # thread: the smallest tiles, and the warps and stages that ptxas fits without spills
        # on every target (found by bench/kernels_aot.py; neighbours spill on some).
        warps, stages = (4, 1) if head_dim_padded <= 64 else (4, 3)
        if head_dim_padded > 128:
            warps, stages = 8, 1
        if fp8_cache:
            # 8-bit tiles in flight beside their widened copies: three stages spill 200-370
            # bytes at 128 dims on every target, one does not.
            stages = 1
        return TileShape(MIN_DOT_SIZE, MIN_DOT_SIZE, num_warps=warps, num_stages=stages)
    if decode:
        # One query row per head of the group: K/V tiles of 8 KiB, so that a thread's share
        # of K, V and the scores stays in registers beside the fp32 accumulator; at 256 dims
        # a third stage in flight costs registers. 8-bit tiles and their widened copies at
        # 128 dims want 8 warps: 4 reach 128 registers and spill 8 bytes on sm_86-sm_90.
        stages = 3 if head_dim_padded <= 128 else 2
        warps = 8 if fp8_cache and head_dim_padded > 64 else 4
        keys = _keys(8 * 1024, head_bytes)
        return TileShape(MIN_DOT_SIZE, keys, num_warps=warps, num_stages=stages)
    # Eight warps hold the 128 x 128 (or 64 x 256) fp32 accumulator. On sm_8x (mma, not
    # sm_90's wgmma) 16 KiB K/V tiles beside it spill, 8 KiB ones do not; with an 8-bit cache
    # (the widened copies beside) 8 KiB ones reach 255 registers, 4 KiB ones stay near 230.
    rows = 128 if head_dim_padded <= 128 else 64
    if capability >= (9, 0):
        kv_tile_bytes = 16 * 1024
    else:
        kv_tile_bytes = 4 * 1024 if fp8_cache else 8 * 1024
    return TileShape(rows, _keys(kv_tile_bytes, head_bytes), num_warps=8, num_stages=3)


def _keys(tile_bytes: int, head_bytes: int) -> int:
    return max(MIN_DOT_SIZE, min(64, tile_bytes // head_bytes))


def choose_tiles(
    head_dim: int,
    element_size: int,
    group: int,
    max_seqlen_q: int,
    capability: tuple[int, int] = DEFAULT_CAPABILITY,
    fp8_cache: bool = False,
) -> AttentionTiles:
    """Tiles for a batch whose longest query run is ``max_seqlen_q``: the decode tile when every
    sequence brings one query, else the prefill tile (chunked prefill and mixed batches).

    Two tile shapes per target, head size and dtype, not one per query count, so that a
    server compiles (and ``bench/kernels_aot.py`` checks) few kernel variants; a prefill tile
    larger than a short chunk costs tensor-core work, not memory traffic.
    """
    shape = tile_shape(
        triton.next_power_of_2(head_dim), element_size, max_seqlen_q == 1, capability, fp8_cache
    )
    rows = max(shape.query_rows, triton.next_power_of_2(group))
    return AttentionTiles(
        query_rows=rows,
        queries=rows // group,
        keys=shape.keys,
        num_warps=shape.num_warps,
        num_stages=shape.num_stages,
    )


def choose_num_kv_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    multiprocessor_count: int,
) -> int:
    """How many parts to split each sequence's keys into (1: no split).

    Only decode batches split: their scratch is small, and with fewer (sequence, KV head)
    programs than multiprocessors a long context would otherwise run on a few of them.
    """
    if max_seqlen_q > 1:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= multiprocessor_count:
        return 1
    to_fill_twice = triton.cdiv(2 * multiprocessor_count, programs)
    worth_splitting = max_seqlen_k // MIN_KEYS_PER_SPLIT
    return max(1, min(to_fill_twice, worth_splitting, MAX_KV_SPLITS))


@triton.jit
def _widen(kv, DTYPE: tl.constexpr):
    """A K or V tile in the dtype the dots take; an 8-bit float one exactly, through fp32 where
    that is free: the compiler folds fp8 -> fp32 -> fp16 into one conversion, and Triton's
    interpreter converts fp8e5 subnormals straight to fp16 wrongly (to fp32 it is exact)."""
    if kv.dtype.is_fp8() and DTYPE == tl.float16:
        return kv.to(tl.float32).to(DTYPE)
    return kv.to(DTYPE)


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, tile_index, num_seqs, queries):
    """The sequence owning query tile ``tile_index``.

    Sequence ``i``'s tiles start at ``cu_seqlens_q[i] // queries + i``: enough room for its
    ``ceil(q_len / queries)`` tiles, found without a host round trip.
    """
    low: tl.int32 = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + middle) // queries + middle
        if first_tile <= tile_index:
            low = middle + 1
        else:
            high = middle
    return low - 1


# Counts that change from batch to batch or model to model are not specialised on (Triton
# would compile a variant for 1 and for multiples of 16): they only index, and one compiled
# kernel per tile shape then serves every batch and GQA group.
@triton.jit(
    do_not_specialize=[
        "sliding_window",
        "num_seqs",
        "num_heads",
        "num_kv_splits",
        "group",
        "queries",
    ]
)
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_out_ptr,  # [num_tokens, num_heads, num_kv_splits, HEAD_DIM_PADDED] fp32
    partial_max_ptr,  # [num_tokens, num_heads, num_kv_splits] fp32
    partial_sum_ptr,  # [num_tokens, num_heads, num_kv_splits] fp32
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], 16/32-bit or 8-bit floats
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_lens_k_ptr,  # [num_seqs] int32
    scale_log2: tl.float32,
    sliding_window: tl.int32,
    num_seqs: tl.int32,
    num_heads: tl.int32,
    num_kv_splits: tl.int32,
    group: tl.int32,
    queries: tl.int32,  # per program: QUERY_ROWS // group
    stride_q_token: tl.int64,
    stride_q_head: tl.int64,
    stride_out_token: tl.int64,
    stride_out_head: tl.int64,
    stride_k_block: tl.int64,
    stride_k_slot: tl.int64,
    stride_k_head: tl.int64,
    stride_v_block: tl.int64,
    stride_v_slot: tl.int64,
    stride_v_head: tl.int64,
    stride_table_seq: tl.int64,
    QUERY_ROWS: tl.constexpr,
    TILE_KEYS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,  # of the dots' operands: Q, K, V and the softmax weights
    DOT_PRECISION: tl.constexpr,
):
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(cu_seqlens_q_ptr, tile_index, num_seqs, queries)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_query = (tile_index - (q_start // queries + seq)) * queries
    if first_query >= q_len:
        return
    kv_len = tl.load(seq_lens_k_ptr + seq)
    context_len = kv_len - q_len

    rows = tl.arange(0, QUERY_ROWS)
    query = first_query + rows // group
    head = kv_head * group + rows % group
    row_valid = (rows < queries * group) & (query < q_len)
    token = (q_start + query).to(tl.int64)
    query_pos = context_len + query
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    q = q.to(COMPUTE_DTYPE)

    # Keys any row of this tile can see: causal up to its last query, windowed from its first.
    last_query = tl.minimum(first_query + queries, q_len) - 1
    kv_end = context_len + last_query + 1
    first_tile = 0
    if USE_WINDOW:
        first_tile = tl.maximum(context_len + first_query - sliding_window + 1, 0) // TILE_KEYS
    end_tile = tl.cdiv(kv_end, TILE_KEYS)
    if SPLIT_KV:
        tiles_per_split = tl.cdiv(end_tile - first_tile, num_kv_splits)
        first_tile = first_tile + split * tiles_per_split
        end_tile = tl.minimum(end_tile, first_tile + tiles_per_split)

    row_max = tl.full([QUERY_ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([QUERY_ROWS], tl.float32)
    acc = tl.zeros([QUERY_ROWS, HEAD_DIM_PADDED], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    key_offsets = tl.arange(0, TILE_KEYS)
    for key_tile in range(first_tile, end_tile):
        key_pos = key_tile * TILE_KEYS + key_offsets
        key_valid = key_pos < kv_end
        block_ids = tl.load(block_table + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        block_ids = block_ids.to(tl.int64)
        slot_in_block = key_pos % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + block_ids[None, :] * stride_k_block
            + slot_in_block[None, :] * stride_k_slot
            + kv_head * stride_k_head
            + dims[:, None],
            mask=dim_valid[:, None] & key_valid[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block_ids[:, None] * stride_v_block
            + slot_in_block[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        k = _widen(k, COMPUTE_DTYPE)
        v = _widen(v, COMPUTE_DTYPE)

        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps max -inf; subtracting 0 keeps it NaN-free.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(
            probs.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION
        )
        row_max = new_max

    if SPLIT_KV:
        partial = ((token * num_heads + head) * num_kv_splits + split).to(tl.int64)
        tl.store(partial_max_ptr + partial, row_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial, row_sum, mask=row_valid)
        tl.store(
            partial_out_ptr + partial[:, None] * HEAD_DIM_PADDED + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )
    else:
        # Rows outside the tile may have seen no key at all; real rows always see their own.
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(
            out_ptr
            + token[:, None] * stride_out_token
            + head[:, None] * stride_out_head
            + dims[None, :],
            out,
            mask=row_valid[:, None] & dim_valid[None, :],
        )


@triton.jit(do_not_specialize=["num_heads", "num_kv_splits"])
def _merge_kv_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    num_heads: tl.int32,
    num_kv_splits: tl.int32,
    stride_out_token: tl.int64,
    stride_out_head: tl.int64,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PADDED)
    split_valid = splits < num_kv_splits
    dims = tl.arange(0, HEAD_DIM_PADDED)
    partial = (token * num_heads + head) * num_kv_splits + splits

    split_max = tl.load(partial_max_ptr + partial, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + partial, mask=split_valid, other=0.0)
    split_out = tl.load(
        partial_out_ptr + partial[:, None] * HEAD_DIM_PADDED + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )
    # Every query sees at least its own key, so some split has a finite max; empty splits
    # (max -inf) get weight 0.
    weight = tl.exp2(split_max - tl.max(split_max, 0))
    out = tl.sum(split_out * weight[:, None], 0) / tl.sum(split_sum * weight, 0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out,
        mask=dims < HEAD_DIM,
    )


# fp32 tiles at head size 256 spill on sm_86/89/90 whatever the warps and stages tried.
FP32_MAX_HEAD_DIM = 128


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    max_seqlen_q: int,
    num_kv_splits: int,
    capability: tuple[int, int] | None = None,
) -> torch.Tensor:
    """:meth:`pagedllm.kernels.backend.KernelOps.paged_attention`, its keys split
    ``num_kv_splits`` ways.

    ``capability`` picks the tiles (and the 8-bit formats taken) for that compute capability
    instead of the device's. A 16- or 32-bit cache is computed with in its dtype, an 8-bit
    float one in the queries' dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens_k.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"K and V caches of one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    fp8_cache = k_cache.dtype in FP8_DTYPES
    compute_dtype = q.dtype if fp8_cache else k_cache.dtype
    if compute_dtype not in _TRITON_DTYPES:
        raise ValueError(
            f"the Triton attention kernel computes in float16, bfloat16 or float32, not "
            f"{compute_dtype} (queries {q.dtype}, KV cache {k_cache.dtype})"
        )
    if compute_dtype == torch.float32 and head_dim > FP32_MAX_HEAD_DIM and not is_interpreting():
        raise ValueError(
            f"the Triton attention kernel takes float32 KV caches up to head size "
            f"{FP32_MAX_HEAD_DIM}, and 8-bit ones with float32 queries (larger fp32 tiles spill "
            f"registers); got {head_dim}: use a float16 or bfloat16 cache or queries"
        )
    if capability is None:
        capability = compute_capability(q.device) or DEFAULT_CAPABILITY
    if (
        k_cache.dtype == torch.float8_e4m3fn
        and capability < FP8_E4M3_MIN_CAPABILITY
        and not is_interpreting()
    ):
        raise ValueError(
            "the Triton attention kernel reads float8_e4m3fn KV caches (kv-cache-dtype fp8, "
            f"fp8_e4m3) on compute capability {FP8_E4M3_MIN_CAPABILITY[0]}."
            f"{FP8_E4M3_MIN_CAPABILITY[1]} and above (Triton has no fp8e4nv below sm_89); this "
            f"is sm_{capability[0]}{capability[1]}: use fp8_e5m2 or auto"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()

    group = num_heads // num_kv_heads
    tiles = choose_tiles(
        head_dim, compute_dtype.itemsize, group, max_seqlen_q, capability, fp8_cache
    )
    head_dim_padded = triton.next_power_of_2(head_dim)
    split_kv = num_kv_splits > 1
    if split_kv:
        partial_out = q.new_empty(
            (num_tokens, num_heads, num_kv_splits, head_dim_padded), dtype=torch.float32
        )
        partial_max = q.new_empty((num_tokens, num_heads, num_kv_splits), dtype=torch.float32)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out
    # The interpreter keeps bf16 as raw 16-bit integers and its tl.dot would multiply those.
    if is_interpreting() and compute_dtype == torch.bfloat16:
        compute_dtype = torch.float32

    grid = (num_tokens // tiles.queries + num_seqs, num_kv_heads, num_kv_splits)
    _paged_attention_kernel[grid](
        out,
        partial_out,
        partial_max,
        partial_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens_k,
        scale * math.log2(math.e),
        sliding_window or 0,
        num_seqs,
        num_heads,
        num_kv_splits,
        group,
        tiles.queries,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        QUERY_ROWS=tiles.query_rows,
        TILE_KEYS=tiles.keys,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        USE_WINDOW=sliding_window is not None,
        SPLIT_KV=split_kv,
        COMPUTE_DTYPE=_TRITON_DTYPES[compute_dtype],
        DOT_PRECISION="ieee" if compute_dtype == torch.float32 else None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if split_kv:
        _merge_kv_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            num_heads,
            num_kv_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            # One padded count for every split count: one compiled merge kernel per head size.
            SPLITS_PADDED=triton.next_power_of_2(max(num_kv_splits, MAX_KV_SPLITS)),
            num_warps=4,
        )
    return out
