"""A checkpoint's tokenizer, loaded without torch (the API servers tokenize but never compute)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.models import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    # Imported here so that worker processes, which never tokenize, start without it.
    from transformers import AutoTokenizer

    directory = Path(model_dir).expanduser()
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ModelLoadError(f"cannot load a tokenizer from {directory}: {error}") from error
