import os
from pathlib import Path

import pytest

# Triton kernels run in its interpreter where there is no GPU; the variable must be set before
# anything imports triton.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# transformers is the parity baseline: its own PyTorch layers, not kernels fetched from the Hub
# (transformers >= 5.25 swaps some in by default; there is no network here and the numerics
# must not depend on a variable nobody set). Set for every process the tests start as well.
os.environ["USE_HUB_KERNELS"] = "NO"


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Compile the C++ CPU kernels once, up front, rather than inside whichever test first
    starts an engine (the build is cached on disk for the servers the tests start)."""
    from pagedllm.kernels import cpu_extension

    cpu_extension.load()
