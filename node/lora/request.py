"""``from pagedllm.lora.request import LoRARequest``: vLLM's import path, which the guide
documents, for the type that lives in :mod:`pagedllm.core.lora_request` (where the scheduler,
below this package, reads it)."""

from __future__ import annotations

from pagedllm.core.lora_request import LoRARequest, adapter_plan_problem

__all__ = ["LoRARequest", "adapter_plan_problem"]
