"""Where PagedLLM keeps what it writes once and reuses: the demo model, benchmark models,
compiled CPU kernels, tokenizers converted from GGUF files."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_DIR_ENV = "PAGEDLLM_CACHE_DIR"


def cache_root() -> Path:
    """``$PAGEDLLM_CACHE_DIR``, or ``~/.cache/pagedllm``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pagedllm")


def cached_dir(target: Path, write: Callable[[Path], object], marker: str | None = None) -> Path:
    """``target``, written by ``write(staging_dir)`` on first use.

    It is assembled in a private directory and renamed into place, so a process never sees a
    half-written one, and of processes racing to create it one wins and the others use it.
    With ``marker``, ``target`` counts as present only once it holds that file.
    """

    def present() -> bool:
        return (target / marker).is_file() if marker else target.is_dir()

    if present():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:
            if not present():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
