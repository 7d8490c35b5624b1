"""PagedLLM: LLM serving with a paged KV cache.

The offline API mirrors vLLM's: ``from pagedllm import LLM, SamplingParams``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.version import __version__ as __version__

__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
]

if TYPE_CHECKING:
    from pagedllm.llm import LLM
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.sampling_params import (
        BeamSearchParams,
        SamplingParams,
        StructuredOutputsParams,
    )


def __getattr__(name: str):
    # Lazy, so that `import pagedllm.operator` does not pull in torch.
    if name == "LLM":
        from pagedllm.llm import LLM

        return LLM
    if name in ("SamplingParams", "BeamSearchParams", "StructuredOutputsParams"):
        from pagedllm import sampling_params

        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedllm import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
