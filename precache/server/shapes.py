"""The nested shapes of OpenAI request bodies: chat messages and their past tool calls, tools,
``tool_choice``, ``response_format`` and vLLM's ``structured_outputs``, as pydantic models.

They and the top-level requests (:mod:`precache.server.protocol`) are the one validation layer:
a body that does not fit them anywhere is a 400 whose ``param`` is the path of the field at fault
(``messages[2].tool_calls[0].function``, :func:`~precache.server.errors.validation_error`), before
any handler reads it, and ``/openapi.json`` publishes them. Objects a chat template reads
(messages, tool calls, tools) keep keys they do not name, passed on as sent; objects that carry a
constraint (``response_format``, ``structured_outputs``) refuse unknown keys.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

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
