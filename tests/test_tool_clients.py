"""Tool calling as the clients send it, on the embedded SmolLM2 through the real openai client: a
forced call of a tool written by the openai SDK's ``pydantic_function_tool`` (an Enum and a nested
model, so ``$ref`` into ``$defs``) and by LangChain's ``convert_to_openai_tool``; a named call ends
with ``finish_reason: "stop"``, a required one with ``"tool_calls"``; an argument holding ``;``
(llama3_json) or ``</tool_call>`` (hermes) stays whole (issue 35)."""

from __future__ import annotations

import enum
import json

import jsonschema
import openai
import pytest
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field

import precache
from precache.resources import adapter_set
from tests.test_server_support import live

pytestmark = pytest.mark.slow

PLAN = adapter_set("qv", ["plan"])["plan"]
ASK = [{"role": "user", "content": "What is the weather in Oslo, in celsius?"}]


class Unit(enum.StrEnum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Place(BaseModel):
    city: str = Field(max_length=12)
    country: str | None = Field(default=None, max_length=12)


class GetWeather(BaseModel):
    """The weather at a place."""

    place: Place
    unit: Unit
    days: int | None = Field(default=None, ge=1, le=7)


def _engine() -> precache.Engine:
    return precache.Engine(precache.load_model(), adapters={"plan": PLAN}, method="prelrshared")


def _const_tool(name: str, value: str) -> dict:
    """A tool whose one argument can only be ``value``: the forced answer is known in advance."""
    schema = {"type": "object", "properties": {"text": {"const": value}}, "required": ["text"]}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


@pytest.fixture(scope="module")
def served():
    with live(_engine(), model_name="smol") as (server, client):
        yield server, client.with_options(timeout=600)


def _arguments(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_an_openai_sdk_tool_with_an_enum_and_a_nested_model_is_forced(served):
    _, client = served
    tool = openai.pydantic_function_tool(GetWeather)
    assert tool["function"]["parameters"]["properties"]["unit"] == {"$ref": "#/$defs/Unit"}
    required = client.chat.completions.create(
        model="plan", messages=ASK, tools=[tool], tool_choice="required", max_tokens=90, temperature=0
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for name, args in _arguments(choice.message):
        assert name == "GetWeather"
        jsonschema.validate(args, tool["function"]["parameters"])  # the enum value is a Unit
        assert args["unit"] in ("celsius", "fahrenheit")
    named = {"type": "function", "function": {"name": "GetWeather"}}
    chunks = list(
        client.chat.completions.create(
            model="plan",
            messages=ASK,
            tools=[tool],
            tool_choice=named,
            max_tokens=90,
            temperature=0,
            stream=True,
        )
    )
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert reasons == ["stop"]  # a named tool_choice ends with stop, as OpenAI and vLLM
    assert len(calls) == 1 and calls[0].function.name == "GetWeather"
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])


def test_a_langchain_tool_is_forced_and_validates(served):
    _, client = served
    tool = convert_to_openai_tool(
        GetWeather, strict=True
    )  # closed objects: a small model cannot add keys forever
    got = client.chat.completions.create(
        model="plan",
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        max_tokens=90,
        temperature=0,
    )
    choice = got.choices[0]
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
    name, args = _arguments(choice.message)[0]
    assert name == "GetWeather"
    jsonschema.validate(args, tool["function"]["parameters"])


def test_hermes_keeps_a_closing_tag_inside_a_required_calls_argument(served):
    _, client = served
    value = "a </tool_call> b"
    got = client.chat.completions.create(
        model="plan",
        messages=ASK,
        tools=[_const_tool("echo", value)],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
    )
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _arguments(choice.message)[0] == ("echo", {"text": value})


def test_llama3_json_keeps_a_semicolon_inside_a_required_calls_argument():
    value = "SELECT 1; SELECT 2"
    with live(_engine(), model_name="smol", tool_call_parser="llama3_json") as (_, client):
        got = client.with_options(timeout=600).chat.completions.create(
            model="plan",
            messages=ASK,
            tools=[_const_tool("run_sql", value)],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=0,
        )
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _arguments(choice.message) == [("run_sql", {"text": value})]
