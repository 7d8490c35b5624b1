"""Per-request generation settings, with vLLM's names and meanings."""

from __future__ import annotations

import hashlib
import json as json_module
from dataclasses import dataclass, field
from typing import Any

# The kinds of constraint StructuredOutputsParams takes, one per request.
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's output constraints: exactly one of ``json`` (a JSON schema, as a dict or its
    text), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (EBNF in
    the GBNF dialect) or ``json_object`` (any JSON object). ``disable_any_whitespace`` keeps
    JSON compact (no whitespace between its tokens)."""

    # A dict given here is kept as its JSON text, so that the settings travel as plain data.
    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        schema: Any = self.json
        if schema is not None and not isinstance(schema, str):
            try:
                self.json = json_module.dumps(schema)
            except (TypeError, ValueError) as error:
                raise ValueError(f"structured_outputs.json must be JSON: {error}") from None
        if self.json_object is False:
            self.json_object = None
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        _require(
            len(given) == 1,
            "structured_outputs",
            f"must set exactly one of {', '.join(CONSTRAINT_KINDS)}",
            given,
        )
        if self.json is not None:
            try:
                parsed = json_module.loads(self.json)
            except ValueError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
            _require(
                isinstance(parsed, (dict, bool)),
                "structured_outputs.json",
                "must be a JSON schema (an object)",
                type(parsed).__name__,
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _require(
                    isinstance(value, str) and bool(value),
                    f"structured_outputs.{name}",
                    "must be a non-empty string",
                    value,
                )
        if self.choice is not None:
            _require(
                isinstance(self.choice, list)
                and bool(self.choice)
                and all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice",
                "must be a non-empty list of non-empty strings",
                self.choice,
            )

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) is not None)

    @property
    def source(self) -> str:
        """The constraint as one text: the schema, the regex, the grammar; the choices as
        the grammar of their alternatives."""
        if self.choice is not None:
            # A GBNF string literal takes JSON's escapes.
            return "root ::= " + " | ".join(
                json_module.dumps(c, ensure_ascii=False) for c in self.choice
            )
        if self.json_object:
            return ""
        value = getattr(self, self.kind)
        assert isinstance(value, str)
        return value

    @property
    def key(self) -> str:
        """Names the compiled grammar: equal for constraints that compile to the same one."""
        text = json_module.dumps([self.kind, self.source, self.disable_any_whitespace])
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass
class SamplingParams:
    """How to generate one request's output(s).

    ``temperature == 0`` is greedy decoding. ``top_k`` of 0 or -1 disables top-k.
    ``best_of`` sequences are generated and the ``n`` with the highest cumulative log
    probability are returned. With ``use_beam_search`` the beam width is ``best_of`` (or ``n``)
    and the ``n`` best beams are returned.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> added to its logit, in [-100, 100] (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never to write; the engine tokenizes them into bad_words_token_ids.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _require(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        if self.best_of is not None:
            _require(
                isinstance(self.best_of, int) and self.best_of >= self.n,
                "best_of",
                f"must be an integer >= n ({self.n})",
                self.best_of,
            )
        _require(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "must be in [-2, 2]",
            self.presence_penalty,
        )
        _require(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "must be in [-2, 2]",
            self.frequency_penalty,
        )
        _require(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            "must be > 0",
            self.repetition_penalty,
        )
        _require(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _require(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            "must be -1 (disable), 0 (disable) or a positive integer",
            self.top_k,
        )
        _require(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        if self.seed is not None:
            _require(isinstance(self.seed, int), "seed", "must be an integer", self.seed)
        if self.max_tokens is not None:
            _require(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                "must be an integer >= 1",
                self.max_tokens,
            )
        _require(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            "must be an integer >= 0",
            self.min_tokens,
        )
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens})",
                self.min_tokens,
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require(
                    isinstance(value, int) and value >= 0,
                    name,
                    "must be a non-negative integer",
                    value,
                )
        _require(
            all(isinstance(s, str) and s for s in self.stop_strings),
            "stop",
            "must be a non-empty string or a list of non-empty strings",
            self.stop,
        )
        _require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative integers",
            self.stop_token_ids,
        )
        if self.use_beam_search:
            _require(
                self.temperature == 0.0 or self.temperature == 1.0,
                "temperature",
                "must be 0 or 1 with beam search",
                self.temperature,
            )
            _require(
                self.beam_width >= 2 or self.n == 1,
                "best_of",
                "beam search needs a beam width (best_of or n)",
                self.best_of,
            )
        if self.structured_outputs is not None:
            self._validate_structured()
        self._validate_token_rules()

    def _validate_token_rules(self) -> None:
        if self.logit_bias is not None:
            _require(
                all(
                    isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0
                    for t, b in self.logit_bias.items()
                ),
                "logit_bias",
                "must map token ids to biases in [-100, 100]",
                self.logit_bias,
            )
        if self.allowed_token_ids is not None:
            _require(
                bool(self.allowed_token_ids)
                and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must be a non-empty list of token ids",
                self.allowed_token_ids,
            )
        if self.bad_words is not None:
            _require(
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                "must be a list of non-empty strings",
                self.bad_words,
            )

    def _validate_structured(self) -> None:
        _require(
            isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
            type(self.structured_outputs).__name__,
        )
        # The grammar decides where the output ends: it cannot also be made to go on.
        for name, clash in (
            ("use_beam_search", self.use_beam_search),
            ("ignore_eos", self.ignore_eos),
            ("min_tokens", self.min_tokens > 0),
        ):
            _require(not clash, name, "cannot be combined with structured_outputs", True)

    @property
    def num_sequences(self) -> int:
        """How many sequences are generated (best_of, or n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def beam_width(self) -> int:
        return self.num_sequences


@dataclass
class BeamSearchParams:
    """Settings of ``LLM.beam_search``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        _require(
            isinstance(self.beam_width, int) and self.beam_width >= 1,
            "beam_width",
            "must be an integer >= 1",
            self.beam_width,
        )
        _require(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            "must be an integer >= 1",
            self.max_tokens,
        )

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width,
            best_of=self.beam_width,
            use_beam_search=True,
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
        )


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, salt: int) -> int:
    """A non-negative 63-bit seed of its own for each ``salt`` (SplitMix64): nearby salts give
    unrelated seeds."""
    return _splitmix64(seed ^ _splitmix64(salt)) & 0x7FFF_FFFF_FFFF_FFFF


def derive_seed(seed: int | None, index: int) -> int | None:
    """Seed of the ``index``-th sequence of a request (index 0 keeps the request's seed)."""
    if seed is None or index == 0:
        return seed
    return mix_seed(seed, index)


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
