"""Property-based fuzzing of every POST endpoint (hypothesis): a valid body of the generation
endpoints or of the run-time adapter routes with any one field, at any depth, replaced by arbitrary
JSON (or a field added) is answered with a 2xx or a 4xx, never a 5xx; every 400 names its field
(``param``), and a stream is well formed (``data:`` events ending with ``[DONE]``). Bounded to 250
bodies so that ``make test`` stays short; a longer run, ``make fuzz`` (10,000 bodies, the count per
endpoint and status written to ``$PRECACHE_FUZZ_REPORT``; issue 35)."""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import precache
from tests.test_server_support import live, tiny_with_tokenizer

TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}},
}
BASES = {
    "/v1/chat/completions": {
        "model": "plan",
        "messages": [
            {"role": "system", "content": "s"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "max_tokens": 2,
        "tool_choice": "none",
        "tools": [TOOL],
        "response_format": {"type": "text"},  # the tiny tokenizer is one llguidance cannot read
        "guided_json": None,
        "stream_options": {"include_usage": True},
        "stream": True,
        "logit_bias": {"5": 1},
        "stop": ["\n"],
    },
    "/v1/completions": {
        "model": "plan",
        "prompt": "hi",
        "max_tokens": 2,
        "guided_regex": None,
        "structured_outputs": None,
        "logprobs": 1,
        "stream": False,
    },
}
#: the run-time adapter routes (vLLM's), fuzzed from bodies that name a real adapter folder
#: (``{adapter}``: filled in by the fixture); a load succeeds while the engine has a spare LR slot
#: and the name is free, an unload while it is loaded
ADAPTER_BASES = {
    "/v1/load_lora_adapter": {"lora_name": "extra", "lora_path": "{adapter}", "load_inplace": False},
    "/v1/unload_lora_adapter": {"lora_name": "extra", "lora_int_id": None},
}
#: cases tried per endpoint and status (written to $PRECACHE_FUZZ_REPORT after the run)
TRIED: dict[str, Counter] = defaultdict(Counter)
FIELD_NAMES = ["type", "function", "name", "schema", "json_schema", "regex", "role", "content", "tools", "x"]

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELD_NAMES), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(value, prefix=()):
    """Every path into ``value`` (dict keys and list indexes), the root excluded."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield (*prefix, key)
        yield from _paths(item, (*prefix, key))


def _replaced(body: dict, path: tuple, new) -> dict:
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = new
    return body


@st.composite
def mutated(draw):
    route = draw(st.sampled_from(sorted(BASES) + sorted(ADAPTER_BASES)))
    base = BASES.get(route) or ADAPTER_BASES[route]
    paths = list(_paths(base))
    if draw(st.booleans()):
        path = draw(st.sampled_from(paths))
    else:  # a new key inside an object of the body (or at its top)
        objects = [()] + [p for p in paths if isinstance(_at(base, p), dict)]
        path = (*draw(st.sampled_from(objects)), draw(st.sampled_from(FIELD_NAMES)))
    return route, _replaced(base, path, draw(JSON)), path


def _at(body, path):
    for key in path:
        body = body[key]
    return body


@pytest.fixture(scope="module")
def http(tiny):
    model, dirs, _ = tiny
    adapter = str(next(iter(dirs.values())))
    # room for two adapters loaded at run time: a load, an unload and a second load can succeed
    engine = precache.Engine(
        tiny_with_tokenizer(model), adapters=dirs, method="prelrshared", max_adapters=len(dirs) + 2
    )
    for body in ADAPTER_BASES.values():
        body.update({k: adapter for k, v in body.items() if v == "{adapter}"})
    with (
        live(engine, runtime_lora=True) as (server, _),
        httpx.Client(base_url=server.url.removesuffix("/v1"), timeout=60) as client,
    ):
        yield client
    report = os.environ.get("PRECACHE_FUZZ_REPORT")
    if report:
        counts = {
            route: {"cases": sum(c.values()), "by_status": dict(sorted(c.items()))}
            for route, c in TRIED.items()
        }
        with open(report, "w", encoding="utf-8") as f:
            json.dump({"total": sum(v["cases"] for v in counts.values()), "endpoints": counts}, f, indent=1)


@pytest.mark.parametrize("route", sorted(BASES))
def test_the_bodies_fuzzed_are_valid_as_they_are(http, route):
    assert http.post(route, json=BASES[route]).status_code == 200


@settings(
    max_examples=int(os.environ.get("PRECACHE_FUZZ_EXAMPLES", "250")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
@given(case=mutated())
def test_no_body_gets_a_5xx_and_every_400_names_its_field(http, case):
    route, body, path = case
    with http.stream("POST", route, json=body) as r:
        text = r.read().decode()
    TRIED[route][str(r.status_code)] += 1
    assert r.status_code < 500, (path, body, text)
    if r.status_code != 200:
        error = json.loads(text)["error"]
        assert error["code"] and error["message"], (path, text)
        assert r.status_code != 400 or error["param"], (path, body, text)
        return
    if route in ADAPTER_BASES:  # vLLM's plain-text answer of a load or an unload
        return
    if body.get("stream") is True:
        events = [line for line in text.split("\n\n") if line]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]", text
        for event in events[:-1]:
            assert "error" not in json.loads(event[6:]), (path, body, event)
    else:
        assert json.loads(text)["choices"], text
