"""The worker's malloc keeps serving big blocks from mappings of their own, however big a block
it freed before (glibc's default threshold follows the biggest, and the heap fragments)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.worker.allocator import MMAP_THRESHOLD

# In a fresh interpreter: mallopt changes the whole process's malloc. Frees a 16 MB block,
# then prints how many blocks have mappings of their own while one 1 MB block is held.
SCRIPT = """
import ctypes, sys
from pagedllm.worker.allocator import fix_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
libc.free(libc.malloc(16 << 20))
before = libc.mallinfo2().hblks
block = libc.malloc(1 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


def mapped_blocks(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_big_blocks_keep_their_own_mappings_after_a_bigger_one_was_freed():
    assert MMAP_THRESHOLD < 1 << 20
    # glibc's default: the freed 16 MB block raised the threshold, the 1 MB block is on the heap
    # (this checks that the measurement can tell).
    assert mapped_blocks("default") == 0
    assert mapped_blocks("fixed") == 1
