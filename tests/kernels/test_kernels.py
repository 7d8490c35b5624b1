"""The Triton kernels agree with their pure-torch references.

They run on CUDA when there is a GPU, else on CPU tensors through Triton's interpreter
(``pagedllm.kernels.triton_device`` sets ``TRITON_INTERPRET=1`` before triton is imported, so a
plain ``pytest tests/test_kernels.py`` works). bf16 differs between the two: on CUDA the
kernel multiplies bf16 on the tensor cores; the interpreter keeps bf16 as raw 16-bit integers,
so there the kernel upcasts K, V and Q to fp32 before its dots, and rounds bf16 results by
truncation rather than to nearest even.

8-bit float caches (``float8_e4m3fn``, ``float8_e5m2``) run in the interpreter too: it keeps
them as bytes and widens them to fp32 exactly (NaN aside: it reads e4m3's NaN as 480 and e5m2's
as a large finite value, which still shows as a mismatch), and the KV write encodes the bytes
itself (see ``pagedllm.kernels.cache_ops``), so the interpreter checks the same bytes and
values a GPU produces.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import pytest
import torch

from pagedllm.kernels import cpu_extension, cpu_ops, kernel_ops, reference, triton_ops
from pagedllm.kernels.triton_device import is_interpreting, triton
from pagedllm.kernels.unified_attention import choose_num_kv_splits, unified_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.filterwarnings(
    # triton 3.5's interpreter turns 1-element arrays into ints the way numpy 1.25 deprecated.
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


@pytest.fixture(autouse=True)
def interpreter_compatible_numpy():
    if not is_interpreting():
        return
    import numpy

    if _version(numpy.__version__) >= (2, 4) and _version(triton.__version__) <= (3, 5):
        pytest.fail(
            f"triton {triton.__version__}'s interpreter converts 1-element arrays with int(), "
            f"which numpy {numpy.__version__} refuses (triton-lang/triton#9171): "
            "install numpy<2.4",
            pytrace=False,
        )


# (atol, rtol) of an attention output against the fp32 reference. fp32: summation order only.
# fp16: the output is rounded to fp16 (2^-11 relative) and the softmax weights are rounded to
# fp16 before the PV product. bf16: 2^-8 relative rounding of output and weights, twice that
# where the interpreter truncates.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
DTYPES = list(TOLERANCES)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64)
# (num_heads, num_kv_heads): multi-head, grouped-query (power of two and not), multi-query.
HEAD_RATIOS = ((4, 4), (8, 2), (6, 2), (4, 1))


@dataclass(frozen=True)
class AttentionCase:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    sliding_window: int | None = None
    cache_dtype: torch.dtype | None = None  # None: the queries' dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.cache_dtype or self.dtype


@dataclass
class PagedBatch:
    """A batch as the engine lays it out, plus what the reference needs to read it.

    Slots that hold no token (the tails of last blocks) and the block that unused block-table
    entries point at are filled with NaN: a kernel that reads them poisons its output. The
    reference gathers whole blocks, so it is given the caches with that NaN zeroed.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    scale: float

    def run_triton(self, case: AttentionCase, num_kv_splits: int | None = None) -> torch.Tensor:
        if num_kv_splits is None:
            return triton_ops.paged_attention(
                self.q,
                self.k_cache,
                self.v_cache,
                self.block_tables,
                self.cu_seqlens_q,
                self.seq_lens_k,
                self.scale,
                sliding_window=case.sliding_window,
                max_seqlen_q=max(case.q_lens),
                max_seqlen_k=max(case.kv_lens),
            )
        return unified_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.cu_seqlens_q,
            self.seq_lens_k,
            self.scale,
            case.sliding_window,
            max(case.q_lens),
            num_kv_splits,
        )

    def run_cpu(self, case: AttentionCase, clean_caches: bool = False) -> torch.Tensor:
        """The CPU backend on CPU copies; ``clean_caches`` zeroes the NaN for its torch
        fallback, which, like the reference, gathers whole blocks."""
        k_cache, v_cache = self.k_cache, self.v_cache
        if clean_caches:
            k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
        return cpu_ops.paged_attention(
            self.q.cpu(),
            k_cache.cpu(),
            v_cache.cpu(),
            self.block_tables.cpu(),
            self.cu_seqlens_q.cpu(),
            self.seq_lens_k.cpu(),
            self.scale,
            sliding_window=case.sliding_window,
            max_seqlen_q=max(case.q_lens),
            max_seqlen_k=max(case.kv_lens),
        )

    def run_reference(self, case: AttentionCase) -> torch.Tensor:
        return reference.paged_attention(
            self.q,
            without_nan(self.k_cache),
            without_nan(self.v_cache),
            self.block_tables,
            self.cu_seqlens_q,
            self.seq_lens_k,
            self.scale,
            sliding_window=case.sliding_window,
        )


def bits(cache: torch.Tensor) -> torch.Tensor:
    """An 8-bit float tensor's bytes (torch compares few ops on them); others as they are."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def without_nan(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` with its NaN zeroed (torch has no nan_to_num for 8-bit floats)."""
    if cache.dtype not in FP8_DTYPES:
        return cache.nan_to_num(0.0)
    clean = cache.clone()
    clean.view(torch.uint8)[cache.float().isnan()] = 0
    return clean


def build_batch(case: AttentionCase, rng: random.Random) -> PagedBatch:
    """Random K/V in shuffled physical blocks; later sequences share earlier ones' full blocks."""
    block_size = case.block_size
    blocks_needed = [math.ceil(n / block_size) for n in case.kv_lens]
    num_blocks = sum(blocks_needed) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    poison = free.pop()
    max_blocks = max(blocks_needed) + 1
    tables: list[list[int]] = []
    for seq, kv_len in enumerate(case.kv_lens):
        table: list[int] = []
        if seq > 0 and rng.random() < 0.5:
            # A shared prefix (prefix cache or fork): only blocks full in both sequences.
            donor = rng.randrange(seq)
            shareable = min(kv_len, case.kv_lens[donor]) // block_size
            table = tables[donor][: rng.randint(0, shareable)]
        table += [free.pop() for _ in range(blocks_needed[seq] - len(table))]
        tables.append(table + [poison] * (max_blocks - len(table)))

    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    shape = (num_blocks, block_size, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=generator)
    v_cache = torch.randn(shape, generator=generator)
    for cache in (k_cache, v_cache):
        cache[poison] = float("nan")
        for table, kv_len in zip(tables, case.kv_lens, strict=True):
            if kv_len % block_size:
                cache[table[kv_len // block_size], kv_len % block_size :] = float("nan")
    k_cache = reference.to_cache(k_cache, case.kv_dtype)
    v_cache = reference.to_cache(v_cache, case.kv_dtype)

    num_tokens = sum(case.q_lens)
    cu_seqlens_q = [0]
    for q_len in case.q_lens:
        cu_seqlens_q.append(cu_seqlens_q[-1] + q_len)
    return PagedBatch(
        q=torch.randn(num_tokens, case.num_heads, case.head_dim, generator=generator)
        .to(case.dtype)
        .to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=DEVICE),
        seq_lens_k=torch.tensor(case.kv_lens, dtype=torch.int32, device=DEVICE),
        scale=case.head_dim**-0.5,
    )


def random_sequences(rng: random.Random, block_size: int) -> tuple[list[int], list[int]]:
    """A mixed batch: decodes, prefill chunks after a cached context, fresh prefills.

    Lengths run from one token to several blocks and hit exact multiples of the block size.
    """
    q_lens, kv_lens = [], []
    for _ in range(rng.randint(2, 5)):
        kind = rng.choice(("decode", "chunk", "prefill"))
        if rng.random() < 0.3:
            kv_len = block_size * rng.randint(1, 3)
        else:
            kv_len = rng.randint(1, 3 * block_size + 5)
        q_len = {
            "decode": 1,
            "chunk": min(kv_len, rng.randint(2, 24)),
            "prefill": min(kv_len, 40),
        }[kind]
        q_lens.append(q_len)
        kv_lens.append(kv_len)
    return q_lens, kv_lens


def randomized_cases(count: int) -> list[AttentionCase]:
    """Every head dim meets every block size once; dtypes and head ratios rotate through."""
    cases = []
    for index in range(count):
        rng = random.Random(index)
        block_size = BLOCK_SIZES[index % len(BLOCK_SIZES)]
        num_heads, num_kv_heads = HEAD_RATIOS[index // 5 % len(HEAD_RATIOS)]
        q_lens, kv_lens = random_sequences(rng, block_size)
        cases.append(
            AttentionCase(
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=HEAD_DIMS[index % len(HEAD_DIMS)],
                block_size=block_size,
                dtype=DTYPES[index % len(DTYPES)],
                q_lens=tuple(q_lens),
                kv_lens=tuple(kv_lens),
                sliding_window=rng.choice((None, None, None, 1, 9, block_size)),
            )
        )
    return cases


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def case_id(case: AttentionCase) -> str:
    window = f"-window{case.sliding_window}" if case.sliding_window else ""
    cache = f"-cache_{dtype_name(case.cache_dtype)}" if case.cache_dtype else ""
    return (
        f"{dtype_name(case.dtype)}{cache}-h{case.num_heads}kv{case.num_kv_heads}"
        f"-d{case.head_dim}-bs{case.block_size}-q{'_'.join(map(str, case.q_lens))}"
        f"-k{'_'.join(map(str, case.kv_lens))}{window}"
    )


def assert_attention_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype):
    atol, rtol = TOLERANCES[dtype]
    assert actual.dtype == expected.dtype
    assert torch.isfinite(actual).all(), "the kernel read a slot that holds no token"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


RANDOMIZED_CASES = randomized_cases(20)


@pytest.mark.parametrize("case", RANDOMIZED_CASES, ids=case_id)
def test_paged_attention_matches_reference(case: AttentionCase):
    batch = build_batch(case, random.Random(case_id(case)))
    assert_attention_close(batch.run_triton(case), batch.run_reference(case), case.dtype)


DECODE_CASES = [
    # Few sequences with long contexts: the shape flash-decoding is for.
    AttentionCase(8, 2, 128, 16, torch.float16, (1, 1, 1), (300, 129, 64)),
    AttentionCase(4, 1, 64, 8, torch.bfloat16, (1, 1), (200, 1)),
    AttentionCase(4, 4, 96, 32, torch.float32, (1, 1, 1, 1), (96, 97, 5, 160)),
    # The kernel also splits mixed batches; the engine only asks it to for decodes.
    AttentionCase(6, 2, 80, 16, torch.float16, (1, 17, 3), (150, 40, 3)),
]


@pytest.mark.parametrize("num_kv_splits", (2, 3, 8))
@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_split_kv_matches_reference(case: AttentionCase, num_kv_splits: int):
    """More splits than key tiles leaves some splits empty; the merge must ignore them."""
    batch = build_batch(case, random.Random(case_id(case)))
    expected = batch.run_reference(case)
    assert_attention_close(batch.run_triton(case, num_kv_splits), expected, case.dtype)


SLIDING_WINDOW_CASES = [
    AttentionCase(4, 2, 64, 16, torch.float16, (1, 30, 1, 12), (90, 70, 16, 12), window)
    for window in (1, 7, 16, 45)
]


@pytest.mark.parametrize("num_kv_splits", (1, 4))
@pytest.mark.parametrize("case", SLIDING_WINDOW_CASES, ids=case_id)
def test_sliding_window_matches_reference(case: AttentionCase, num_kv_splits: int):
    batch = build_batch(case, random.Random(case.sliding_window))
    expected = batch.run_reference(case)
    assert_attention_close(batch.run_triton(case, num_kv_splits), expected, case.dtype)


E4M3, E5M2 = FP8_DTYPES
# 8-bit caches, read in place and widened to the queries' dtype: decodes, prefill chunks after
# a cached context and fresh prefills in one batch (the random prefix sharing of build_batch
# included), with every query dtype, a sliding window, and a head size that pads.
FP8_CASES = [
    AttentionCase(8, 2, 64, 16, torch.float16, (1, 17, 3, 1), (150, 40, 3, 64), None, E4M3),
    AttentionCase(8, 2, 64, 16, torch.float16, (1, 17, 3, 1), (150, 40, 3, 64), None, E5M2),
    AttentionCase(4, 1, 128, 32, torch.bfloat16, (24, 1, 9), (24, 70, 33), None, E4M3),
    AttentionCase(6, 2, 80, 8, torch.bfloat16, (1, 12, 1), (41, 30, 8), 9, E5M2),
    AttentionCase(4, 4, 64, 16, torch.float32, (1, 30, 1), (90, 70, 16), 16, E4M3),
]
# Flash-decoding over 8-bit caches: several splits, some empty.
FP8_DECODE_CASES = [
    AttentionCase(8, 2, 128, 16, torch.float16, (1, 1, 1), (300, 129, 64), None, E5M2),
    AttentionCase(4, 1, 64, 8, torch.bfloat16, (1, 1), (200, 1), 40, E4M3),
    AttentionCase(4, 4, 96, 32, torch.float32, (1, 1, 1), (96, 97, 5), None, E5M2),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=case_id)
def test_paged_attention_over_fp8_caches_matches_reference(case: AttentionCase):
    batch = build_batch(case, random.Random(case_id(case)))
    assert batch.k_cache.dtype == case.cache_dtype
    assert_attention_close(batch.run_triton(case), batch.run_reference(case), case.dtype)


@pytest.mark.parametrize(
    "capability, cache_dtype", [((8, 0), E5M2), ((8, 9), E4M3)], ids=("sm_80", "sm_89")
)
def test_fp8_tiles_of_other_targets_match_reference(
    capability: tuple[int, int], cache_dtype: torch.dtype
):
    """sm_8x's tiles for 8-bit caches (fewer keys per prefill tile than sm_90's, which the
    interpreter picks by default), with the format each target takes."""
    case = AttentionCase(8, 2, 128, 16, torch.float16, (1, 40, 3), (150, 40, 60), None, cache_dtype)
    batch = build_batch(case, random.Random(case_id(case)))
    out = unified_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.cu_seqlens_q,
        batch.seq_lens_k,
        batch.scale,
        None,
        max(case.q_lens),
        1,
        capability,
    )
    assert_attention_close(out, batch.run_reference(case), case.dtype)


@pytest.mark.parametrize("case", FP8_DECODE_CASES, ids=case_id)
def test_split_kv_over_fp8_caches_matches_reference(case: AttentionCase):
    batch = build_batch(case, random.Random(case_id(case)))
    expected = batch.run_reference(case)
    assert_attention_close(batch.run_triton(case, num_kv_splits=5), expected, case.dtype)


# The C++ decode kernel tiles a KV head's query heads four at a time: groups of 2, 5 and 8
# leave tiles of every size; head dims 64 and 128 take its vectorized path, 80 the plain one.
CPU_TILE_CASES = [
    AttentionCase(10, 2, 64, 16, torch.float32, (1, 1, 1), (300, 17, 16), None),
    AttentionCase(16, 2, 128, 16, torch.bfloat16, (1, 1), (129, 33), 40),
    AttentionCase(4, 2, 64, 32, torch.float16, (1, 1, 1, 1), (1, 2, 95, 64), None),
    AttentionCase(10, 2, 80, 8, torch.float32, (1, 1), (77, 8), 9),
]
# Speculative decoding's verification steps (a token and its drafts per sequence) beside plain
# decodes and a prefill chunk: the short steps run as decode rows of their own lengths.
VERIFY_CASES = [
    AttentionCase(9, 3, 64, 16, torch.float32, (5, 1, 3, 16, 17), (300, 40, 3, 64, 90), None),
    AttentionCase(8, 2, 64, 16, torch.float32, (5, 5, 2), (100, 21, 30), 7),
]
CPU_CASES = RANDOMIZED_CASES + DECODE_CASES + SLIDING_WINDOW_CASES + CPU_TILE_CASES + VERIFY_CASES


def test_cpu_kernels_build_with_the_system_compiler():
    assert cpu_extension.load(), "the C++ CPU kernels did not build (see the warning logged)"
    assert kernel_ops("auto", torch.device("cpu")) is cpu_ops


@pytest.mark.parametrize("case", CPU_CASES, ids=case_id)
def test_cpu_backend_matches_reference(case: AttentionCase):
    """The C++ decode kernel reads only slots that hold tokens: the NaN stays unread."""
    assert cpu_extension.load()
    batch = build_batch(case, random.Random(case_id(case)))
    expected = batch.run_reference(case).cpu()
    assert_attention_close(batch.run_cpu(case), expected, case.dtype)


@pytest.mark.parametrize("case", CPU_CASES[::3], ids=case_id)
def test_cpu_backend_without_the_compiled_kernel_matches_reference(
    case: AttentionCase, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(cpu_extension, "load", lambda: False)
    batch = build_batch(case, random.Random(case_id(case)))
    expected = batch.run_reference(case).cpu()
    assert_attention_close(batch.run_cpu(case, clean_caches=True), expected, case.dtype)


def test_paged_attention_without_max_seqlens_reads_them_from_the_batch():
    case = AttentionCase(4, 2, 64, 16, torch.float16, (1, 9), (33, 20))
    batch = build_batch(case, random.Random(0))
    out = triton_ops.paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.cu_seqlens_q,
        batch.seq_lens_k,
        batch.scale,
    )
    assert_attention_close(out, batch.run_reference(case), case.dtype)


def test_split_kv_is_chosen_only_for_decode_batches_that_leave_multiprocessors_idle():
    h200 = 132
    assert choose_num_kv_splits(1, 8, 1, 8192, h200) > 1
    assert choose_num_kv_splits(4, 8, 1, 2048, h200) > 1
    assert choose_num_kv_splits(32, 8, 1, 8192, h200) == 1
    assert choose_num_kv_splits(1, 8, 1, 300, h200) == 1
    assert choose_num_kv_splits(1, 8, 512, 8192, h200) == 1


@pytest.mark.parametrize(
    "key_dtype, cache_dtype",
    [(d, d) for d in DTYPES]
    + [(torch.float32, torch.float16)]
    + [(d, fp8) for d, fp8 in zip(DTYPES, (*FP8_DTYPES, *FP8_DTYPES), strict=False)],
    ids=lambda dtype: dtype_name(dtype),
)
def test_write_kv_matches_reference(key_dtype: torch.dtype, cache_dtype: torch.dtype):
    num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks = 13, 6, 3, 80, 16, 5
    generator = torch.Generator().manual_seed(0)
    # K and V come out of a fused QKV projection: views with a token stride wider than a row.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator)
    qkv = (qkv * 4).to(key_dtype).to(DEVICE)
    key = qkv[:, num_heads : num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[2, 7, 8]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=generator).to(cache_dtype).to(DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    cpu_k, cpu_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    triton_ops.write_kv(key, value, k_cache, v_cache, slots.to(DEVICE))
    reference.write_kv(key, value, expected_k, expected_v, slots.to(DEVICE))
    cpu_ops.write_kv(key.cpu(), value.cpu(), cpu_k, cpu_v, slots)

    assert torch.equal(bits(k_cache), bits(expected_k))
    assert torch.equal(bits(v_cache), bits(expected_v))
    assert torch.equal(bits(cpu_k), bits(expected_k.cpu()))
    assert torch.equal(bits(cpu_v), bits(expected_v.cpu()))


def every_value(dtype: torch.dtype) -> torch.Tensor:
    """Keys that a write into an 8-bit cache must round and saturate like the reference: every
    16-bit float (infinities, NaN and subnormals included), or for fp32 the midpoints between
    neighbouring values of both 8-bit formats and their fp32 neighbours (ties to even, carries
    into the exponent, subnormals), far-out and tiny values, and random ones of every scale."""
    if dtype.itemsize == 2:
        return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = []
    for fp8 in FP8_DTYPES:
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
        grid = grid[torch.isfinite(grid)].unique()
        midpoints = (grid[1:] + grid[:-1]) / 2
        for toward in (float("inf"), float("-inf")):
            values.append(midpoints.nextafter(torch.full_like(midpoints, toward)))
        values += [midpoints, grid]
    generator = torch.Generator().manual_seed(3)
    scales = torch.exp2(torch.randint(-30, 20, (2**14,), generator=generator).float())
    values.append(torch.randn(2**14, generator=generator) * scales)
    special = [0.0, -0.0, 1e30, -1e30, 1e-30, -1e-30, 3e38, float("inf"), float("-inf")]
    values.append(torch.tensor([*special, float("nan"), 1e-45, -1e-45]))
    return torch.cat(values)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("key_dtype", DTYPES, ids=dtype_name)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN, infinities
def test_write_kv_rounds_and_saturates_into_fp8_like_the_reference(
    key_dtype: torch.dtype, cache_dtype: torch.dtype
):
    num_kv_heads, head_dim, block_size = 16, 256, 16
    values = every_value(key_dtype)
    rows = math.ceil(values.numel() / (num_kv_heads * head_dim))
    key = torch.zeros(rows * num_kv_heads * head_dim, dtype=key_dtype)
    key[: values.numel()] = values
    key = key.view(rows, num_kv_heads, head_dim).to(DEVICE)
    # The largest values (and infinities) saturate; a slot of -1 is skipped.
    assert bool((key.float().abs() > torch.finfo(cache_dtype).max).any())
    slots = torch.randperm(2 * rows, generator=torch.Generator().manual_seed(0))[:rows]
    slots[1] = -1
    shape = (math.ceil(2 * rows / block_size), block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 1.0, dtype=cache_dtype, device=DEVICE)
    v_cache, expected_k, expected_v = k_cache.clone(), k_cache.clone(), k_cache.clone()

    triton_ops.write_kv(key, -key, k_cache, v_cache, slots.to(DEVICE))
    reference.write_kv(key, -key, expected_k, expected_v, slots.to(DEVICE))

    for actual, expected in ((k_cache, expected_k), (v_cache, expected_v)):
        nan = expected.float().isnan()
        assert torch.equal(actual.float().isnan(), nan)
        assert torch.equal(bits(actual)[~nan], bits(expected)[~nan])


def make_layers(
    num_layers: int, dtype: torch.dtype, num_blocks: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    # One allocation for all layers, K and V of a block side by side, as an engine may lay
    # them out: each cache is a strided view whose blocks are still contiguous.
    stacked = torch.randn(num_layers, num_blocks, 2, 16, 2, 64, generator=generator)
    stacked = stacked.to(dtype).to(DEVICE)
    return [(stacked[layer, :, 0], stacked[layer, :, 1]) for layer in range(num_layers)]


@pytest.mark.parametrize("dtype", DTYPES + list(FP8_DTYPES), ids=dtype_name)
def test_copy_blocks_copies_every_layer_like_the_reference(dtype: torch.dtype):
    layers = make_layers(3, dtype)
    expected = [(k.clone(), v.clone()) for k, v in layers]
    # A block shared by two forks is copied twice; 6 -> 0 copies downwards.
    pairs = torch.tensor([[2, 5], [2, 7], [6, 0]], dtype=torch.int32, device=DEVICE)

    triton_ops.copy_blocks(layers, pairs)
    reference.copy_blocks(expected, pairs)

    for (k, v), (expected_k, expected_v) in zip(layers, expected, strict=True):
        assert torch.equal(bits(k), bits(expected_k))
        assert torch.equal(bits(v), bits(expected_v))


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_name)
def test_fp8_cache_written_forked_and_read_like_the_reference(cache_dtype: torch.dtype):
    """A prompt written into an 8-bit cache (some values saturating), a fork sharing its full
    blocks and copying its partial last block on write, then a token of each's own: Triton's
    write and copy leave the reference's bytes, and its attention over the shared and copied
    blocks (the parent's whole prompt as a prefill, the fork's token as a decode) reads them
    as the reference does."""
    num_heads, num_kv_heads, head_dim, block_size, prompt = 4, 2, 64, 16, 37
    generator = torch.Generator().manual_seed(5)
    shape = (6, block_size, num_kv_heads, head_dim)
    layers = {
        backend: [tuple(torch.zeros(shape, dtype=cache_dtype, device=DEVICE) for _ in "kv")]
        for backend in (triton_ops, reference)
    }
    tables = torch.tensor([[4, 1, 3], [4, 1, 0]], dtype=torch.int32, device=DEVICE)

    def write(key: torch.Tensor, value: torch.Tensor, table: torch.Tensor, positions: list[int]):
        slots = torch.tensor(
            [int(table[pos // block_size]) * block_size + pos % block_size for pos in positions],
            device=DEVICE,
        )
        for backend, [(k_cache, v_cache)] in layers.items():
            backend.write_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots)

    def random_kv(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Keys past e4m3's 448 saturate; the queries are as much smaller.
        kv = torch.randn(2, tokens, num_kv_heads, head_dim, generator=generator)
        return (kv[0] * 150).half(), kv[1].half()

    write(*random_kv(prompt), tables[0], list(range(prompt)))
    pairs = torch.tensor([[3, 0]], device=DEVICE)  # blocks 4 and 1 stay shared
    for backend, backend_layers in layers.items():
        backend.copy_blocks(backend_layers, pairs)
    for seq in range(2):
        write(*random_kv(1), tables[seq], [prompt])
    [(k_cache, v_cache)] = layers[triton_ops]
    [(expected_k, expected_v)] = layers[reference]
    assert torch.equal(bits(k_cache), bits(expected_k))
    assert torch.equal(bits(v_cache), bits(expected_v))
    assert k_cache.float().abs().max() == torch.finfo(cache_dtype).max or cache_dtype == E5M2
    assert not torch.equal(bits(k_cache[0]), bits(k_cache[3]))  # the copies diverged

    q_lens = [prompt + 1, 1]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator) / 150
    q = q.half().to(DEVICE)
    layout = {
        "block_tables": tables,
        "cu_seqlens_q": torch.tensor([0, prompt + 1, prompt + 2], dtype=torch.int32).to(DEVICE),
        "seq_lens_k": torch.tensor([prompt + 1] * 2, dtype=torch.int32, device=DEVICE),
        "scale": head_dim**-0.5,
    }
    out = triton_ops.paged_attention(q, k_cache, v_cache, **layout)
    expected = reference.paged_attention(q, expected_k, expected_v, **layout)
    assert_attention_close(out, expected, torch.float16)


def test_copy_blocks_without_pairs_changes_nothing():
    layers = make_layers(2, torch.float16)
    before = [(k.clone(), v.clone()) for k, v in layers]
    triton_ops.copy_blocks(layers, torch.empty(0, 2, dtype=torch.int64, device=DEVICE))
    for (k, v), (k_before, v_before) in zip(layers, before, strict=True):
        assert torch.equal(k, k_before) and torch.equal(v, v_before)


def test_copy_blocks_refuses_caches_of_different_layouts():
    (k, v), *_ = make_layers(1, torch.float16)
    other = torch.zeros(8, 16, 2, 32, dtype=torch.float16, device=DEVICE)
    pairs = torch.tensor([[0, 1]], device=DEVICE)
    with pytest.raises(ValueError, match="one dtype, shape and strides"):
        triton_ops.copy_blocks([(k, v), (other, other)], pairs)


def test_kernels_run_compiled_on_a_gpu_and_interpreted_without_one():
    assert kernel_ops("triton", DEVICE) is triton_ops
    if DEVICE.type == "cuda":
        assert not is_interpreting()
    else:
        assert is_interpreting()
        assert os.environ["TRITON_INTERPRET"] == "1"
