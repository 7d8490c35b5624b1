"""glibc's malloc in the worker: big blocks always get their own mapping.

glibc serves a block of at least its mmap threshold from a mapping of its own, unmapped when
freed, and smaller ones from its heap. By default the threshold follows the largest mapped
block freed so far (up to 32 MB), so after the first long prefill every activation of a step
comes from the heap, where blocks that live longer (cached primitives, Python objects) pin the
pages between them: the worker's heap grew by 77 MB of free space over 12 rounds of
``bench/soak.py`` while the memory it used stayed flat. A fixed threshold stops the drift (and
with it the trim threshold's, so that free memory at the heap's top goes back to the system):
only blocks below it share the heap. Mapping a step's big activations afresh costs page faults,
a few percent of a long prefill's compute and nothing at decode, where they are small.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# glibc's mallopt parameter (malloc.h), and the threshold: twice glibc's starting one.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 10


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold for this process; False where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        log.warning("glibc refused mmap threshold %d; the heap may fragment", threshold)
        return False
    return True
