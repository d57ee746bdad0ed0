"""One validation layer for the whole request body: every wrong type or shape anywhere in a request
(nested messages and their tool calls, tools, tool_choice, response_format, stream_options, vLLM's
structured-output fields, the adapter routes) is a 400 in the OpenAI error format whose ``param``
is the path of the field at fault and whose ``code`` says what is wrong, streamed or not, before
anything is sent. The cases are public bug reports against other servers (issue 35)."""

from __future__ import annotations

import httpx
import pytest

from precache.server.errors import field_path, validation_error
from tests.test_server_support import live, tiny_engine

USER = {"role": "user", "content": "hi"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _chat(**fields):
    return ("/v1/chat/completions", {"model": "plan", "messages": [USER], "max_tokens": 3, **fields})


def _completion(**fields):
    return ("/v1/completions", {"model": "plan", "prompt": "hi", "max_tokens": 3, **fields})


def _calls(calls, tools: bool):
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": calls}, USER]
    return _chat(messages=messages, **({"tools": [WEATHER]} if tools else {}))


# (name, path, body, param, code)
CASES = [
    (
        "json_schema a string",
        *_chat(response_format={"type": "json_schema", "json_schema": "x"}),
        "response_format.json_schema",
        "invalid_type",
    ),
    (
        "json_schema a list",
        *_chat(response_format={"type": "json_schema", "json_schema": [1]}),
        "response_format.json_schema",
        "invalid_type",
    ),
    (
        "json_schema without schema",
        *_chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "response_format.json_schema.schema",
        "missing_required_parameter",
    ),
    (
        "json_schema missing",
        *_completion(response_format={"type": "json_schema"}),
        "response_format.json_schema",
        "missing_required_parameter",
    ),
    (
        "response_format unknown type",
        *_chat(response_format={"type": "yaml"}),
        "response_format.type",
        "invalid_value",
    ),
    ("response_format a string", *_chat(response_format="json"), "response_format", "invalid_type"),
    (
        "tool_choice function a string",
        *_chat(tools=[WEATHER], tool_choice={"type": "function", "function": "get_weather"}),
        "tool_choice.function",
        "invalid_type",
    ),
    (
        "tool_choice unknown word",
        *_chat(tools=[WEATHER], tool_choice="always"),
        "tool_choice",
        "invalid_value",
    ),
    (
        "tool_choice names no tool",
        *_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
        "tool_choice.function.name",
        "invalid_value",
    ),
    ("tool_calls of a string, tools", *_calls(["x"], True), "messages[1].tool_calls[0]", "invalid_type"),
    ("tool_calls of a string", *_calls(["x"], False), "messages[1].tool_calls[0]", "invalid_type"),
    (
        "tool_call function a string, tools",
        *_calls([{"function": "x"}], True),
        "messages[1].tool_calls[0].function",
        "invalid_type",
    ),
    (
        "tool_call function a string",
        *_calls([{"function": "x"}], False),
        "messages[1].tool_calls[0].function",
        "invalid_type",
    ),
    ("tool_calls a string, tools", *_calls("abc", True), "messages[1].tool_calls", "invalid_type"),
    ("tool_calls a string", *_calls("abc", False), "messages[1].tool_calls", "invalid_type"),
    (
        "tool_call without a name",
        *_calls([{"function": {"arguments": "{}"}}], False),
        "messages[1].tool_calls[0].function.name",
        "missing_required_parameter",
    ),
    (
        "tool_call arguments a number",
        *_calls([{"function": {"name": "f", "arguments": 5}}], False),
        "messages[1].tool_calls[0].function.arguments",
        "invalid_type",
    ),
    (
        "content a number",
        *_chat(messages=[{"role": "user", "content": 5}]),
        "messages[0].content",
        "invalid_type",
    ),
    (
        "content part without type",
        *_chat(messages=[{"role": "user", "content": [{"text": "a"}]}]),
        "messages[0].content[0].type",
        "missing_required_parameter",
    ),
    ("message a string", *_chat(messages=[USER, "hi"]), "messages[1]", "invalid_type"),
    ("role missing", *_chat(messages=[{"content": "hi"}]), "messages[0].role", "missing_required_parameter"),
    ("tools a dict", *_chat(tools={"type": "function"}), "tools", "invalid_type"),
    ("tool a string", *_chat(tools=[WEATHER, "f"]), "tools[1]", "invalid_type"),
    (
        "parameters a list",
        *_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
        "tools[0].function.parameters",
        "invalid_type",
    ),
    (
        "parameters a string",
        *_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
        "tools[0].function.parameters",
        "invalid_type",
    ),
    (
        "parameters not an object schema",
        *_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
        "tools[0].function.parameters",
        "invalid_value",
    ),
    ("stream_options a string", *_chat(stream=True, stream_options="x"), "stream_options", "invalid_type"),
    (
        "stream_options unknown key",
        *_chat(stream=True, stream_options={"usage": True}),
        "stream_options.usage",
        "unknown_parameter",
    ),
    ("guided_json a number", *_completion(guided_json=5), "guided_json", "invalid_type"),
    ("guided_json text not an object", *_completion(guided_json="[1]"), "guided_json", "invalid_value"),
    ("guided_json text not JSON", *_completion(guided_json="{"), "guided_json", "invalid_value"),
    ("guided_regex Python refuses", *_completion(guided_regex="foo**"), "guided_regex", "invalid_value"),
    ("guided_regex a list", *_completion(guided_regex=["a"]), "guided_regex", "invalid_type"),
    ("guided_choice a string", *_completion(guided_choice="yes"), "guided_choice", "invalid_type"),
    ("guided_choice of numbers", *_completion(guided_choice=["a", 1]), "guided_choice[1]", "invalid_type"),
    (
        "structured_outputs regex Python refuses",
        *_chat(structured_outputs={"regex": "(a"}),
        "structured_outputs.regex",
        "invalid_value",
    ),
    (
        "structured_outputs unknown key",
        *_chat(structured_outputs={"xml": "<a/>"}),
        "structured_outputs.xml",
        "unknown_parameter",
    ),
    ("structured_outputs a list", *_chat(structured_outputs=["regex"]), "structured_outputs", "invalid_type"),
    ("stop of numbers", *_completion(stop=["a", 3]), "stop[1]", "invalid_type"),
    ("logit_bias value text", *_completion(logit_bias={"5": "x"}), "logit_bias.5", "invalid_type"),
    ("documents of strings", *_chat(documents=["a"]), "documents[0]", "invalid_type"),
    ("prompt an object", *_completion(prompt={"a": 1}), "prompt", "invalid_type"),
]


@pytest.fixture(scope="module")
def served(tiny):
    with live(tiny_engine(tiny, "prelrshared"), runtime_lora=True) as (server, client):
        yield server, client


def _post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    return http.post(path, json=body)


def test_every_malformed_shape_is_a_400_naming_its_path(served):
    server, _ = served
    assert len({c[0] for c in CASES}) == len(CASES)
    with httpx.Client(base_url=server.url.removesuffix("/v1"), timeout=60) as http:
        got = {}
        for name, path, body, _, _ in CASES:
            r = _post(http, path, body)
            error = r.json()["error"]
            got[name] = (r.status_code, error["param"], error["code"])
            assert error["type"] == "invalid_request_error" and error["message"].startswith(error["param"])
        assert http.post("/v1/completions", json=_completion()[1]).status_code == 200  # still serving
    assert got == {name: (400, param, code) for name, _, _, param, code in CASES}


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_schema_that_does_not_compile_is_a_400_before_anything_is_sent(served, stream):
    server, _ = served
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
    ref = {"type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}}  # $defs missing
    dangling = {"type": "function", "function": {"name": "g", "parameters": ref}}
    for tools, param in [
        ([WEATHER, bad], "tools[1].function.parameters"),
        ([dangling], "tools[0].function.parameters"),
    ]:
        for choice in ("auto", "required"):
            body = {**_chat(tools=tools, tool_choice=choice, stream=stream)[1]}
            with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=60) as r:
                r.read()
            assert r.status_code == 400 and r.headers["content-type"] == "application/json"
            error = r.json()["error"]
            assert (error["param"], error["code"]) == (param, "invalid_schema")
            assert "properties must be an object" in error["message"] or "/$defs/Unit" in error["message"]


def test_adapter_routes_name_the_field_too(served):
    server, _ = served
    root = server.url.removesuffix("/v1")
    r = httpx.post(f"{root}/v1/load_lora_adapter", json={"lora_name": 5, "lora_path": "/x"}, timeout=30)
    assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == (
        "lora_name",
        "invalid_type",
    )
    r = httpx.post(f"{root}/v1/unload_lora_adapter", json={"lora_name": "plan", "extra": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra"


def test_the_openapi_schema_publishes_the_nested_shapes(served):
    server, _ = served
    spec = httpx.get(server.url.removesuffix("/v1") + "/openapi.json", timeout=30).json()
    shapes = spec["components"]["schemas"]
    assert {"ChatRequest", "ChatMessage", "MessageToolCall", "Tool", "ResponseFormat"} <= set(shapes)
    assert shapes["MessageToolCall"]["required"] == ["function"]


def test_the_path_drops_union_members_and_takes_the_deepest_error():
    assert (
        field_path(("body", "messages", 2, "tool_calls", 0, "function"))
        == "messages[2].tool_calls[0].function"
    )
    assert field_path(("body", "prompt", "list[int]", 0)) == "prompt[0]"
    assert field_path(("body", "tool_choice", "NamedToolChoice", "function")) == "tool_choice.function"
    errors = [
        {"type": "literal_error", "loc": ("body", "tool_choice", "literal['none','auto']"), "msg": "a"},
        {"type": "model_type", "loc": ("body", "tool_choice", "NamedToolChoice", "function"), "msg": "b"},
    ]
    err = validation_error(errors)
    assert (err.status, err.param, err.code) == (400, "tool_choice.function", "invalid_type")
