"""Where PagedLLM keeps what it writes once and reuses: the demo model, benchmark models,
compiled CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PAGEDLLM_CACHE_DIR"


def cache_root() -> Path:
    """``$PAGEDLLM_CACHE_DIR``, or ``~/.cache/pagedllm``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pagedllm")
