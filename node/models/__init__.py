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

# The weight and activation dtypes a model can be served in; "auto" takes the checkpoint's.
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_CHOICES = ("auto", *DTYPES)
# How weights are held (pagedllm.models.quantized): None keeps a GGUF file's quantized tensors
# quantized, and every other weight in the dtype.
QUANTIZATION_CHOICES = ("gguf", "int8", "none")


class ModelLoadError(ValueError):
    """A model directory that cannot be served; the message says what is wrong."""
