"""Draft tokens by prompt lookup: what followed the sequence's tail where it occurred before.

vLLM's n-gram proposer: the longest n (``max_n`` down to ``min_n``) for which the last n
tokens occur earlier in the sequence; at its earliest occurrence, the up to ``k`` tokens that
follow it are the draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens``, or none when its last ``min_n`` tokens
    occur nowhere before."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.shape[0]
    if k < 1 or size <= min_n:
        return []
    # Candidates: ends of earlier matches of the tail, narrowed one token further back per
    # round; each round costs one vectorised comparison over the survivors only.
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    best_len, best_end = 0, -1
    for length in range(1, min(max_n, size - 1) + 1):
        if length > 1:
            ends = ends[ends >= length - 1]
            ends = ends[arr[ends - (length - 1)] == arr[size - length]]
        if ends.size == 0:
            break
        best_len, best_end = length, int(ends[0])
    if best_len < min_n:
        return []
    start = best_end + 1
    return arr[start : start + k].tolist()
