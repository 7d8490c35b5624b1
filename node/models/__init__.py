"""Model implementations, by the Hugging Face architecture name in ``config.json``."""

from __future__ import annotations

from pagedllm.models.llama import CausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(MODEL_CLASSES)
