"""The nested shapes of OpenAI request bodies: chat messages and their past tool calls, tools,
``tool_choice``, ``response_format`` and vLLM's ``structured_outputs``, as pydantic models; and
the one structured-output constraint a request's fields carry (:func:`structured_output`).

They and the top-level requests (:mod:`precache.server.protocol`) are the one validation layer:
a body that does not fit them anywhere is a 400 whose ``param`` is the path of the field at fault
(``messages[2].tool_calls[0].function``, :func:`~precache.server.errors.validation_error`), before
any handler reads it, and ``/openapi.json`` publishes them. Objects a chat template reads
(messages, tool calls, tools) keep keys they do not name, passed on as sent; objects that carry a
constraint (``response_format``, ``structured_outputs``) refuse unknown keys.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

from precache.config import StructuredOutput
from precache.server.errors import refuse

#: a function name, as OpenAI allows it
FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


def _compiles(pattern: str) -> str:
    """A regex pattern Python's ``re`` accepts (the grammar engine accepts some it refuses, e.g.
    ``foo**``, and other servers would refuse them)."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from None
    return pattern


#: a regular expression the output must match in full
Regex = Annotated[str, AfterValidator(_compiles)]


class ContentPart(BaseModel):
    """One part of a message's content (only ``text`` parts are served)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class CalledFunction(BaseModel):
    """The function of a past call: ``arguments`` is JSON text (OpenAI) or an object."""

    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    """One entry of an assistant message's ``tool_calls``."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """A chat message: every other key is passed to the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    """A function the model may call: ``parameters`` is the JSON schema of its arguments, an object
    schema (absent or ``{}``: no arguments)."""

    model_config = ConfigDict(extra="allow")

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (schema or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
            raise ValueError(f"must be an object schema (the arguments are a JSON object), got type {kind!r}")
        return schema


class Tool(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function to call: ``{"type": "function", "function": {"name"}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the output's JSON schema (``schema``) and its name."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object``, or ``json_schema`` with its schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema, or its JSON text), ``regex``,
    ``choice``, ``grammar`` (Lark) or ``json_object``."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: Regex | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


#: the request fields that carry a structured-output constraint
STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def structured_output(req: BaseModel) -> StructuredOutput | None:
    """The request's one structured-output constraint: OpenAI's ``response_format`` (``json_object``,
    ``json_schema``) or vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar`` / ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``); None when it has none. The shapes are already checked (the request models).

    Raises:
        APIError: 400 naming the field: two constraints, or a value no constraint can be built from.
    """
    found: list[tuple[str, StructuredOutput]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutput.json_object()))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise refuse(
                "response_format.json_schema",
                "type json_schema needs json_schema with its schema",
                "missing_required_parameter",
            )
        found.append(("response_format", StructuredOutput.json_schema(fmt.json_schema.json_schema)))
    vllm = req.structured_outputs.model_dump(by_alias=True) if req.structured_outputs else {}
    guided = {
        "guided_json": ("json", req.guided_json),
        "guided_regex": ("regex", req.guided_regex),
        "guided_choice": ("choice", req.guided_choice),
        "guided_grammar": ("grammar", req.guided_grammar),
        **{f"structured_outputs.{key}": (key, value) for key, value in vllm.items()},
    }
    for name, (kind, value) in guided.items():
        if value is None or value is False:
            continue
        try:
            found.append((name.split(".", 1)[0], _constraint(kind, value)))
        except (ValueError, TypeError) as exc:
            raise refuse(name, f"{name}: {exc}", "invalid_value") from None
    if len(found) > 1:
        names = ", ".join(sorted({n for n, _ in found}))
        raise refuse(
            found[1][0], f"one structured-output constraint per request, got {names}", "invalid_value"
        )
    return found[0][1] if found else None


def _constraint(kind: str, value: Any) -> StructuredOutput:
    """A vLLM structured-output field's constraint (``kind``: json, regex, choice, grammar or
    json_object). Raises ValueError: JSON text that is not an object, an empty choice."""
    if kind == "json" and isinstance(value, str):
        schema = json.loads(value)  # a JSONDecodeError is a ValueError
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be an object")
        return StructuredOutput.json_schema(schema)
    return {
        "json": StructuredOutput.json_schema,
        "json_object": lambda _: StructuredOutput.json_object(),
        "regex": StructuredOutput.regex,
        "choice": StructuredOutput.choice,
        "grammar": StructuredOutput.grammar,
    }[kind](value)
