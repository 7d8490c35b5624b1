"""A checkpoint's tokenizer, loaded without torch (the API servers tokenize but never compute)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.models import ModelLoadError
from pagedllm.models.gguf import find_gguf_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a Hugging Face model directory, or of a GGUF file (or a directory
    holding exactly one), converted from its metadata."""
    gguf_file = find_gguf_file(model_dir)
    if gguf_file is not None:
        from pagedllm.models.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(gguf_file)
    # Imported here so that worker processes, which never tokenize, start without it.
    from transformers import AutoTokenizer

    directory = Path(model_dir).expanduser()
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ModelLoadError(f"cannot load a tokenizer from {directory}: {error}") from error
