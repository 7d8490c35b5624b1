"""The offline API, compatible with vLLM's ``LLM``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.config import EngineConfig
from pagedllm.core.lora_request import LoRARequest
from pagedllm.llm_engine import LLMEngine
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

Prompt = str | dict[str, Any]
Message = dict[str, str]


class LLM:
    """Generate text for batches of prompts with a paged KV cache.

    >>> llm = LLM()  # the built-in demo model
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        known = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown settings {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs of ``prompts``, in order; ``lora_request`` names the LoRA adapter of every
        prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(
            SamplingParams() if sampling_params is None else sampling_params,
            SamplingParams,
            prompts,
        )
        loras = _per_prompt(lora_request, LoRARequest, prompts)
        ids = [
            self.engine.add_request(p, sp, lora_request=lora)
            for p, sp, lora in zip(prompts, params, loras, strict=True)
        ]
        return self._run(ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            while len(done) < len(wanted) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in wanted - set(done):
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [done[i] for i in request_ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            ids = self.engine.tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tokenize=True,
            )
            if not isinstance(ids, list):  # newer transformers return a BatchEncoding
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        outputs = self.generate(
            list(prompts), params.to_sampling_params(), use_tqdm=False, lora_request=lora_request
        )
        results = []
        for out in outputs:
            results.append(
                BeamSearchOutput(
                    [
                        BeamSearchSequence(
                            out.prompt_token_ids + c.token_ids, c.text, c.cumulative_logprob or 0.0
                        )
                        for c in out.outputs
                    ]
                )
            )
        return results


def _per_prompt(value: Any, one: type, prompts: list[Prompt]) -> list[Any]:
    """``value`` for each prompt: one ``one`` (or None) for all, or a sequence of one each."""
    if value is None or isinstance(value, one):
        return [value] * len(prompts)
    values = list(value)
    if len(values) != len(prompts):
        raise ValueError(
            f"got {len(values)} {one.__name__} for {len(prompts)} prompts; give one or one per "
            "prompt"
        )
    return values
