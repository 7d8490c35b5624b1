"""The tokenizer and chat template of a GGUF file, built from its metadata without torch.

A GGUF has no ``tokenizer.json``: it stores the vocabulary, merges, token types, special token
ids and chat template under llama.cpp's keys. transformers' GGUF integration turns those into a
``tokenizers`` tokenizer (``convert_gguf_tokenizer``), but its own reader of the file imports
torch, which the API servers never load; so the metadata comes from our reader and only the
conversion from transformers. The result is saved as an ordinary Hugging Face tokenizer
directory in the cache, keyed by the file's identity, so that every later process (each API
server, each restart) loads it in the usual, fast way.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.cache import cache_root, cached_dir
from pagedllm.models import ModelLoadError
from pagedllm.models.gguf import GGUFFile

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# Bumped whenever the conversion changes, so that an old cached tokenizer is not reused.
CONVERSION_VERSION = 1
CACHE_SUBDIR = "gguf-tokenizers"
_TOKENIZER_KEY = "tokenizer.ggml."
# The special tokens transformers' tokenizer config names, and the metadata holding their ids.
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def load_gguf_tokenizer(gguf_file: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of ``gguf_file``, converted once and then read from the cache."""
    from transformers import AutoTokenizer

    try:
        directory = cached_dir(
            tokenizer_cache_dir(gguf_file),
            lambda staging: build_gguf_tokenizer(gguf_file).save_pretrained(staging),
            marker="tokenizer_config.json",
        )
    except OSError as error:
        # A read-only or full cache: convert in memory, as every process will have to.
        log.warning("cannot cache the tokenizer of %s (%s); converting it here", gguf_file, error)
        return build_gguf_tokenizer(gguf_file)
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ModelLoadError(
            f"cannot load the tokenizer converted from {gguf_file} (cached in {directory}; "
            f"remove that directory to convert again): {error}"
        ) from error


def tokenizer_cache_dir(gguf_file: Path) -> Path:
    """Where the tokenizer of ``gguf_file`` is cached: named after the file's path, size and
    modification time, so that a replaced file is converted again."""
    stat = gguf_file.stat()
    identity = f"{gguf_file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CONVERSION_VERSION}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_root() / CACHE_SUBDIR / f"{gguf_file.stem}-{digest}"


def build_gguf_tokenizer(gguf_file: Path) -> PreTrainedTokenizerBase:
    """Convert the tokenizer described by ``gguf_file``'s metadata (no cache)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    file = GGUFFile.open(gguf_file)
    architecture = file.architecture()
    tokenizer_dict, config = tokenizer_metadata(file)
    try:
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (ValueError, KeyError, TypeError) as error:
        raise ModelLoadError(f"cannot build a tokenizer from {gguf_file}: {error}") from error
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def tokenizer_metadata(file: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tokenizer_dict, tokenizer_config)`` as transformers' ``get_gguf_tokenizer`` gives them:
    the vocabulary for the converter, and the special tokens and chat template for the
    tokenizer object."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    metadata = file.contents.metadata
    tokens = metadata.get(f"{_TOKENIZER_KEY}tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(
            f"{file.path} holds no tokenizer (metadata {_TOKENIZER_KEY}tokens); "
            "pass --tokenizer DIR"
        )
    groups = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = file.optional_integer(f"{_TOKENIZER_KEY}{key}")
        if token_id is not None and token_id >= len(tokens):
            raise ModelLoadError(
                f"{file.path}: {_TOKENIZER_KEY}{key} {token_id} is outside the vocabulary "
                f"of {len(tokens)} tokens"
            )
        config[name] = tokens[token_id] if token_id is not None else None
    context = file.value(f"{file.architecture()}.context_length")
    if isinstance(context, int) and context > 0:
        config["model_max_length"] = context
    return tokenizer_dict, config
