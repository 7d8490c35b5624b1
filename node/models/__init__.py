"""Model implementations, by the Hugging Face architecture name in ``config.json``.

The package itself imports no torch, so that the tokenizer (``pagedllm.models.tokenizer``)
loads in processes that never compute (the API servers).
"""

from __future__ import annotations

# All served by pagedllm.models.llama.CausalLM (see pagedllm.models.loader.MODEL_CLASSES).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class ModelLoadError(ValueError):
    """A model directory that cannot be served; the message says what is wrong."""
