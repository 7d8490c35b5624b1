"""A request's output constraint, from whichever of its fields names one: vLLM's
``structured_outputs``, the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, or OpenAI's ``response_format``. Only its form is checked here; whether it
compiles is the engine's to say (the API server has no grammar compiler)."""

from __future__ import annotations

from pagedllm.api.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.sampling_params import StructuredOutputsParams


class ConstraintError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def output_constraint(
    body: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    """The constraint the request asks for, or None; ``ConstraintError`` when it asks for
    more than one or one that is malformed."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    so = body.structured_outputs
    if so is not None:
        found.append(
            (
                "structured_outputs",
                _params(
                    "structured_outputs",
                    json=so.json_schema,
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                    json_object=so.json_object,
                    disable_any_whitespace=so.disable_any_whitespace,
                ),
            )
        )
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(body, name)
        if value is not None:
            found.append((name, _params(name, **{kind: value})))
    response_format = _from_response_format(body)
    if response_format is not None:
        found.append(("response_format", response_format))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ConstraintError(f"give one output constraint, not several ({names})", found[1][0])
    return found[0][1] if found else None


def _from_response_format(
    body: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _params("response_format", json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise ConstraintError(
            'response_format of type "json_schema" needs json_schema.schema',
            "response_format",
        )
    return _params("response_format", json=fmt.json_schema.json_schema)


def _params(param: str, **fields: object) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)  # type: ignore[arg-type]
    except ValueError as error:
        raise ConstraintError(str(error), param) from None
