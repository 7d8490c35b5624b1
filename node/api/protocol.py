"""OpenAI-compatible request bodies (pydantic), with vLLM's extra sampling fields.

These models are the HTTP border: types, ranges and finiteness are checked here, so that
everything behind them can trust its input. Unknown fields are ignored, as OpenAI clients
send fields of newer API versions; fields that would change the answer but are not supported
are refused by name (see ``unsupported_fields``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# The API's integer ranges (vLLM's): a seed is a 64-bit integer, counts and token ids 32-bit.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_SAMPLES = 128
MAX_LOGPROBS = 20


def _encodable(text: str) -> str:
    # JSON may carry unpaired surrogates ("\ud800"), which no tokenizer or encoder accepts.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no unpaired surrogates)") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` request field (exactly one constraint)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Text
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Body):
    model: Text | None = None
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    temperature: FiniteFloat | None = Field(None, ge=0.0)
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: FiniteFloat | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: FiniteFloat | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: dict[str, FiniteFloat] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[Text] | None = None
    # vLLM fields this server does not implement (refused by name when set).
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None
    priority: int | None = None
    truncate_prompt_tokens: int | None = None
    # Output constraints: vLLM's field, its older guided_* names, OpenAI's response_format.
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None
    response_format: ResponseFormat | None = None

    # Fields this server does not implement, refused when set rather than silently ignored.
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "guided_whitespace_pattern",
        "prompt_logprobs",
        "return_tokens_as_token_ids",
        "priority",
        "truncate_prompt_tokens",
    )

    def unsupported_fields(self) -> list[str]:
        return [name for name in self.UNSUPPORTED if getattr(self, name, None)]


class CompletionRequest(_SamplingFields):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: Count | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None

    UNSUPPORTED = (*_SamplingFields.UNSUPPORTED, "suffix")


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCallIn(_Body):
    name: Text
    arguments: Text


class ToolCallIn(_Body):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    # An assistant turn's calls, and a tool turn's answer to one of them.
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    # Accepted and ignored: they change nothing in the answer.
    metadata: dict[str, Any] | None = None
    store: bool | None = None

    UNSUPPORTED = (*_SamplingFields.UNSUPPORTED, "functions")


class TokenizeCompletionRequest(_Body):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True


class TokenizeChatRequest(_Body):
    """A chat rendered as a chat completion would render it (vLLM's fields)."""

    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class LoadLoRAAdapterRequest(_Body):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: Text
    lora_path: Text


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (``lora_int_id`` is accepted, unused)."""

    lora_name: Text
    lora_int_id: int | None = None


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[TokenId]


def error_body(
    message: str, kind: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape. Text quoted from the request is made encodable first, so that
    no input can break the error answer itself."""
    return {
        "error": {
            "message": _printable(message),
            "type": kind,
            "param": None if param is None else _printable(param),
            "code": code,
        }
    }


def _printable(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")
