"""Tool calling as vLLM serves it: the request's tools and tool_choice checked, the parsers read
calls back (and write past calls) in their formats, and on the embedded SmolLM2 a required or
named call is guaranteed by the constraint, parses, and validates against the function's schema,
streamed or not; tool_choice none keeps the tools out of the prompt."""

from __future__ import annotations

import enum
import json

import httpx
import jsonschema
import openai
import pytest
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field

import precache
from precache.config import StructuredOutput
from precache.engine.outputs import Turn
from precache.engine.structured import validate_structured_output
from precache.resources import adapter_set
from precache.server.errors import APIError
from precache.server.protocol import ChatRequest, parse_request
from precache.server.responses import Renderer
from precache.server.tool_parsers import TOOL_PARSERS, Function, get_parser, lift_definitions
from precache.server.tools import tool_constraint, tool_request
from tests.test_server_support import live

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 20}},
            "required": ["tz"],
        },
    },
}


# -- requests and parsers (no model) ------------------------------------------------------------
def tools_of(tools, choice, parallel=None):
    """The request's ToolRequest, read as the server reads it (the request models, then tool_request)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": choice}
    req = parse_request(ChatRequest, {**body, "tools": tools, "parallel_tool_calls": parallel})
    return tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)


def _with_parameters(parameters):
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize(
    ("tools", "choice", "param", "code"),
    [
        ([{"type": "function"}], "auto", "tools[0].function", "missing_required_parameter"),
        ([{"type": "retrieval", "function": {"name": "x"}}], "auto", "tools[0].type", "invalid_value"),
        ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools[0].function.name", None),
        ([WEATHER, WEATHER], "auto", "tools[1].function.name", "invalid_value"),
        ([WEATHER], "sometimes", "tool_choice", "invalid_value"),
        (
            [WEATHER],
            {"type": "function", "function": {"name": "get_time"}},
            "tool_choice.function.name",
            None,
        ),
        ([WEATHER], {"type": "function", "function": "get_weather"}, "tool_choice.function", "invalid_type"),
        ([WEATHER], {"type": "function"}, "tool_choice.function", "missing_required_parameter"),
        (None, "required", "tool_choice", "invalid_value"),
        ([_with_parameters([])], "auto", "tools[0].function.parameters", "invalid_type"),
        ([_with_parameters("object")], "auto", "tools[0].function.parameters", "invalid_type"),
        ([_with_parameters({"type": "string"})], "auto", "tools[0].function.parameters", "invalid_value"),
        (
            [WEATHER, _with_parameters({"type": "object", "properties": 5})],
            "required",
            "tools[1].function.parameters",
            "invalid_schema",
        ),
        (
            [_with_parameters({"type": "object", "properties": {"u": {"$ref": "#/$defs/Missing"}}})],
            "auto",
            "tools[0].function.parameters",
            "invalid_schema",
        ),
    ],
)
def test_malformed_tools_and_choices_are_400s_naming_the_path(tools, choice, param, code):
    with pytest.raises(APIError) as err:
        tools_of(tools, choice)
    assert err.value.status == 400 and err.value.param == param and err.value.code
    assert code is None or err.value.code == code
    assert err.value.message.startswith(param)


def test_the_command_line_names_every_parser():
    from precache.server.config import TOOL_PARSER_NAMES

    assert tuple(sorted(TOOL_PARSER_NAMES)) == tuple(sorted(TOOL_PARSERS))


def test_tool_choice_none_and_no_tools_mean_no_tool_request():
    assert tools_of([WEATHER], "none") is None
    assert tools_of(None, None) is None
    assert tools_of([WEATHER], None).choice == "auto"  # OpenAI's default with tools
    assert tools_of([_with_parameters({})], None).functions[0].parameters == {
        "type": "object",
        "properties": {},
    }
    named = tools_of([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True)
    assert (named.choice, named.function, named.parallel) == ("function", "get_time", False)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_each_parser_reads_back_the_calls_it_writes(name):
    parser = get_parser(name)
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
    ]
    content, parsed = parser.parse(parser.write(calls))
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET"}),
    ]


def test_hermes_keeps_the_text_around_calls_and_plain_text_has_no_call():
    parser = get_parser("hermes")
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Let me check." and calls[0].name == "get_weather"
    assert parser.parse("It is sunny.") == ("It is sunny.", [])
    assert parser.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


# -- the server on SmolLM2 ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    plan = adapter_set("qv", ["plan"])["plan"]
    engine = precache.Engine(precache.load_model(), adapters={"plan": plan}, method="prelrshared")
    with live(engine, model_name="smol") as (server, client):
        yield server, client


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, tool):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.slow
def test_required_and_named_calls_parse_and_validate(served):
    _, client = served
    got = client.chat.completions.create(
        model="plan",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    named = client.chat.completions.create(
        model="plan",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80,
        temperature=0,
    )
    assert len(named.choices[0].message.tool_calls) == 1
    _check_call(named.choices[0].message.tool_calls[0], TIME)


@pytest.mark.slow
def test_a_streamed_required_call_arrives_as_tool_call_deltas(served):
    server, _ = served
    body = {
        "model": "plan",
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 80,
        "temperature": 0,
        "stream": True,
    }
    deltas, reasons = [], []
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for c in json.loads(line[6:])["choices"]:
            deltas.append(c["delta"])
            reasons.append(c["finish_reason"])
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert reasons[-1] == "tool_calls" and [c["index"] for c in calls] == list(range(len(calls)))
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.slow
def test_tool_choice_none_keeps_the_tools_out_of_the_prompt_and_auto_answers(served):
    _, client = served
    plain = client.chat.completions.create(model="plan", messages=ASK, max_tokens=4, temperature=0)
    none = client.chat.completions.create(
        model="plan", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # vLLM's default: tools not rendered
    assert none.choices[0].message.content == plain.choices[0].message.content
    auto = client.chat.completions.create(
        model="plan", messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0
    )
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the tool prompt is in
    message = auto.choices[0].message
    assert message.content or message.tool_calls


@pytest.mark.slow
def test_a_tool_round_trip_renders_the_call_and_its_result(served):
    _, client = served
    first = client.chat.completions.create(
        model="plan", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    second = client.chat.completions.create(
        model="plan", messages=messages, tools=[WEATHER], max_tokens=20, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in


def test_every_parser_grammar_compiles_and_forces_a_call():
    # the grammar is llguidance's Lark: a required call in each format compiles for a real tokenizer
    from precache.engine.structured import GrammarMatcher

    model = precache.load_model(require_tokenizer=True)
    for name in sorted(TOOL_PARSERS):
        spec = tool_constraint(tools_of([WEATHER, TIME], "required", True), get_parser(name))
        GrammarMatcher(model.tokenizer, model.config.vocab_size, spec)


@pytest.mark.slow
def test_parallel_tool_calls_false_answers_one_call(served):
    _, client = served
    got = client.chat.completions.create(
        model="plan",
        messages=[{"role": "user", "content": "Weather in Paris and time in CET?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    calls = got.choices[0].message.tool_calls
    assert len(calls) == 1  # the constraint allows one call, and the answer keeps the first only
    _check_call(calls[0], WEATHER if calls[0].function.name == "get_weather" else TIME)


# -- tools as the clients write them: $defs lifted to the top of the call schema -----------------
class Unit(enum.StrEnum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Place(BaseModel):
    city: str = Field(max_length=20)
    country: str | None = None


class GetWeather(BaseModel):
    """The weather at a place."""

    place: Place
    unit: Unit
    days: int | None = None


class Tree(BaseModel):
    label: str = Field(max_length=8)
    children: list[Tree] = Field(max_length=2)


def _other_unit_tool() -> dict:
    """A second tool whose ``$defs`` also holds a ``Unit``, a different one."""
    return {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "$defs": {"Unit": {"enum": ["s", "ms"]}},
                "properties": {"unit": {"$ref": "#/$defs/Unit"}},
                "required": ["unit"],
            },
        },
    }


def test_the_openai_sdk_tool_has_its_defs_lifted_and_refs_kept():
    tool = openai.pydantic_function_tool(GetWeather)
    assert tool["function"]["parameters"]["properties"]["unit"] == {
        "$ref": "#/$defs/Unit"
    }  # what the SDK emits
    functions = tools_of([tool], "required").functions
    (arguments,), defs = lift_definitions(list(functions))
    assert set(defs) == {"Place", "Unit"} and defs["Unit"]["enum"] == ["celsius", "fahrenheit"]
    assert "$defs" not in arguments and arguments["properties"]["unit"] == {"$ref": "#/$defs/Unit"}


def test_clashing_def_names_are_renamed_and_a_root_reference_is_lifted():
    functions = list(
        tools_of([openai.pydantic_function_tool(GetWeather), _other_unit_tool()], "required").functions
    )
    (weather, time_args), defs = lift_definitions(functions)
    assert defs["Unit"]["enum"] == ["celsius", "fahrenheit"] and defs["get_time.Unit"] == {
        "enum": ["s", "ms"]
    }
    assert time_args["properties"]["unit"] == {"$ref": "#/$defs/get_time.Unit"}
    recursive = Function("walk", "", {"type": "object", "properties": {"next": {"$ref": "#"}}})
    (args,), defs = lift_definitions([recursive])
    assert args == {"$ref": "#/$defs/walk.parameters"}
    assert defs["walk.parameters"]["properties"]["next"] == {"$ref": "#/$defs/walk.parameters"}


@pytest.fixture(scope="module")
def smol_tokenizer():
    model = precache.load_model(require_tokenizer=True)
    return model.tokenizer, model.config.vocab_size


def _accepts(spec, tokenizer_vocab, text: str) -> bool:
    from precache.engine.structured import GrammarMatcher

    tokenizer, vocab = tokenizer_vocab
    matcher = GrammarMatcher(tokenizer, vocab, spec).matcher
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids)


CLIENT_TOOLS = {
    "openai": lambda: openai.pydantic_function_tool(GetWeather),
    "langchain": lambda: convert_to_openai_tool(GetWeather),
}
WEATHER_ARGS = {"place": {"city": "Oslo", "country": None}, "unit": "celsius", "days": None}


@pytest.mark.parametrize("client", sorted(CLIENT_TOOLS))
@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_client_tools_with_enums_and_nested_models_can_be_forced(smol_tokenizer, client, name):
    parser = get_parser(name)
    tool = CLIENT_TOOLS[client]()
    for choice in ("required", {"type": "function", "function": {"name": "GetWeather"}}):
        spec = tool_constraint(tools_of([tool, TIME], choice), parser)
        validate_structured_output(spec)  # compiles: every $ref resolves
        call = [{"function": {"name": "GetWeather", "arguments": json.dumps(WEATHER_ARGS)}}]
        good = parser.write(call)
        bad = good.replace("celsius", "kelvin")  # not in the Enum
        layout = good.replace(", ", ",").replace(": ", ":")  # the grammar's JSON has no free whitespace
        assert _accepts(spec, smol_tokenizer, good) or _accepts(spec, smol_tokenizer, layout)
        assert not _accepts(spec, smol_tokenizer, bad) and not _accepts(
            spec, smol_tokenizer, bad.replace(", ", ",")
        )


def test_a_recursive_model_from_the_openai_sdk_can_be_forced():
    spec = tool_constraint(tools_of([openai.pydantic_function_tool(Tree)], "required"), get_parser("hermes"))
    validate_structured_output(spec)
    assert '"$ref": "#/$defs/Tree"' in spec.spec


# -- parsers never split or stop inside a JSON string -------------------------------------------
def test_llama3_json_keeps_a_semicolon_inside_an_argument():
    parser = get_parser("llama3_json")
    one = '{"name": "run_sql", "parameters": {"query": "SELECT 1; SELECT 2"}}'
    content, calls = parser.parse(one)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("run_sql", {"query": "SELECT 1; SELECT 2"})
    ]
    content, calls = parser.parse(f'<|python_tag|>{one}; {{"name": "ls", "parameters": {{"dir": "a;b"}}}}')
    assert [json.loads(c.arguments) for c in calls] == [{"query": "SELECT 1; SELECT 2"}, {"dir": "a;b"}]
    assert parser.parse(f"{one} and more") == (f"{one} and more", [])  # not only calls: content


def test_hermes_keeps_a_closing_tag_inside_an_argument():
    parser = get_parser("hermes")
    text = '<tool_call>\n{"name": "echo", "arguments": {"text": "a </tool_call> b"}}\n</tool_call>'
    content, calls = parser.parse(text)
    assert content is None and json.loads(calls[0].arguments) == {"text": "a </tool_call> b"}
    two = f"Sure.\n{text}\n{text.replace('echo', 'say')}"
    content, calls = parser.parse(two)
    assert content == "Sure." and [c.name for c in calls] == ["echo", "say"]


def _cut_answer(name: str) -> tuple[str, list]:
    parser = get_parser(name)
    calls = [
        {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
    ]
    whole = parser.write(calls)
    return whole[: whole.rindex("CET")], calls  # max_tokens ran out inside the second call


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_a_forced_answer_keeps_its_complete_calls_when_the_last_is_cut(name):
    parser = get_parser(name)
    cut, _ = _cut_answer(name)
    content, calls = parser.parse(cut, forced=True)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parser.parse(cut) == (cut, [])  # auto: a cut call makes the answer content, as vLLM
    assert parser.parse(cut[:10], forced=True) == (cut[:10], [])  # no complete call: the text is content


# -- finish reasons as OpenAI defines them ------------------------------------------------------
def _rendered(text: str, stop_reason: str, tools, parser: str = "hermes") -> dict:
    turn = Turn(agent=None, token_ids=[5, 6], text=text, stop_reason=stop_reason)
    renderer = Renderer("chat", "m", [1], codec=None, tool_parser=get_parser(parser), tools=tools)
    return renderer.body([turn])["choices"][0]


def test_finish_reasons_for_auto_required_named_and_cut_calls():
    call = get_parser("hermes").write([{"function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}])
    required, named = (
        tools_of([WEATHER, TIME], "required"),
        tools_of([TIME], {"type": "function", "function": {"name": "get_time"}}),
    )
    assert _rendered(call, "stop", tools_of([TIME], "auto"))["finish_reason"] == "tool_calls"
    assert _rendered("It is noon.", "eos", tools_of([TIME], "auto"))["finish_reason"] == "stop"
    assert _rendered(call, "stop", required)["finish_reason"] == "tool_calls"
    choice = _rendered(call, "stop", named)
    assert (
        choice["finish_reason"] == "stop"
        and choice["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    )
    for name in sorted(TOOL_PARSERS):
        cut, _ = _cut_answer(name)
        choice = _rendered(cut, "length", required, name)
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


def test_definitions_are_lifted_like_defs_and_response_format_schemas_compile():
    old_style = json.loads(
        json.dumps(openai.pydantic_function_tool(GetWeather)).replace("$defs", "definitions")
    )
    assert old_style["function"]["parameters"]["properties"]["unit"] == {"$ref": "#/definitions/Unit"}
    tools = tools_of([old_style], "required")
    (arguments,), defs = lift_definitions(list(tools.functions))
    assert set(defs) == {"Place", "Unit"} and arguments["properties"]["place"] == {"$ref": "#/$defs/Place"}
    validate_structured_output(tool_constraint(tools, get_parser("hermes")))
    for schema in (GetWeather.model_json_schema(), old_style["function"]["parameters"]):  # a response_format
        validate_structured_output(StructuredOutput.json_schema(schema))
