"""Speculative decoding's settings, vLLM's ``speculative_config``, checked at every border.

Only the n-gram (prompt lookup) method exists: drafts come from the sequence's own tokens
(``ngram_proposer``), so no second model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram",)
# Beyond this a verification step is mostly wasted work: acceptance falls off geometrically.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's lookup window when neither bound is given.
DEFAULT_LOOKUP = 5
# Above this many requests in the node, steps draft nothing. A step is bound by reading the
# weights only while its batch is small; at a large one a verification pass costs about as
# many times a plain step as it carries tokens per sequence, more than its accepted drafts
# save (measured on SmolLM2 and the benchmark model: 1.33x at 16 requests, 11 % slower at 32).
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Draft up to ``num_speculative_tokens`` tokens per step from the longest match
    (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) of the sequence's tail in its
    own prompt and output, while at most ``disable_by_batch_size`` requests are running or
    waiting (None: at any number)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config: unknown method {self.method!r}; supported: {list(METHODS)}"
            )
        _int_in("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        _int_in("prompt_lookup_max", self.prompt_lookup_max, None)
        _int_in("prompt_lookup_min", self.prompt_lookup_min, None)
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, None)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def _int_in(name: str, value: object, most: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"speculative_config: {name} must be at most {most}, got {value}")


def parse_speculative_config(
    value: SpeculativeConfig | Mapping[str, Any] | str | None,
) -> SpeculativeConfig | None:
    """The settings in ``value`` (a config, a dict or its JSON text; None: off), or
    ``ValueError`` naming what is wrong. As in vLLM, a missing lookup bound takes the other's
    value, and both missing take 5; ``disable_by_batch_size`` null drafts at any batch size,
    and missing takes 16."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config: not JSON ({error})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; known: {list(_KEYS)}")
    if "method" not in value:
        raise ValueError('speculative_config: "method" is required (e.g. "ngram")')
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    low = value.get("prompt_lookup_min")
    high = value.get("prompt_lookup_max")
    low = low if low is not None else high if high is not None else DEFAULT_LOOKUP
    high = high if high is not None else low
    return SpeculativeConfig(
        method=value["method"],
        num_speculative_tokens=value["num_speculative_tokens"],
        prompt_lookup_max=high,
        prompt_lookup_min=low,
        disable_by_batch_size=value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE),
    )
