import os
import sys
from pathlib import Path

# Triton kernels run in its interpreter where there is no GPU; the variable must be set before
# anything imports triton.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test helpers (fake workers, tiny model builders) live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
