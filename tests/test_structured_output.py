"""Structured output on the embedded SmolLM2 (its real byte-level tokenizer): every output of a
JSON-schema, JSON-object, regex, choice or grammar constraint parses and validates, in the library
and in the server, constrained requests batch with unconstrained ones, and a bad constraint is a
clear error before anything runs."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import precache
from precache.config import StructuredOutput
from precache.errors import StructuredOutputError
from precache.resources import adapter_set
from tests.test_server_support import live

pytestmark = pytest.mark.slow

PLAN = adapter_set("qv", ["plan"])["plan"]
ASK = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine():
    return precache.Engine(precache.load_model(), adapters={"plan": PLAN}, method="prelrshared")


def _generate(engine, spec, **params):
    s = engine.session()
    s.append(ASK)
    return s.generate("plan", structured_output=spec, **{"max_new_tokens": 120, "temperature": 0.0, **params})


# -- schemas: small JSON schemas whose instances are short (strings and arrays are bounded) -------
_leaf = st.one_of(
    st.fixed_dictionaries({"type": st.just("string"), "maxLength": st.integers(1, 12)}),
    st.fixed_dictionaries(
        {"type": st.just("integer"), "minimum": st.integers(-50, 0), "maximum": st.integers(1, 99)}
    ),
    st.fixed_dictionaries({"type": st.just("boolean")}),
    st.fixed_dictionaries(
        {
            "enum": st.lists(
                st.sampled_from(["red", "green", "blue", "x y"]), min_size=1, max_size=3, unique=True
            )
        }
    ),
)
_names = st.sampled_from(["name", "age", "city", "tags", "ok", "id", "note"])


def _object(values):
    return st.dictionaries(_names, values, min_size=1, max_size=3).flatmap(
        lambda props: st.fixed_dictionaries(
            {
                "type": st.just("object"),
                "properties": st.just(props),
                "required": st.lists(st.sampled_from(sorted(props)), unique=True),
                "additionalProperties": st.just(False),
            }
        )
    )


SCHEMAS = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        _object(inner),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner, "maxItems": st.integers(1, 3)}),
    ),
    max_leaves=6,
).filter(lambda s: s.get("type") in ("object", "array"))


@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(SCHEMAS, min_size=50, max_size=50))
def test_fifty_generated_schemas_all_validate_batched_together(engine, schemas):
    requests = []
    for schema in schemas:
        s = engine.session()
        s.append(ASK)
        spec = StructuredOutput.json_schema(schema)
        requests.append(s.submit("plan", structured_output=spec, max_new_tokens=160, temperature=0.0))
    turns = engine.wait_all(requests)
    for schema, turn in zip(schemas, turns, strict=True):
        assert turn.stop_reason in ("stop", "eos"), (schema, turn.text)
        jsonschema.validate(json.loads(turn.text), schema)


def test_json_object_regex_choice_and_grammar(engine):
    obj = _generate(engine, StructuredOutput.json_object(), max_new_tokens=400)
    assert obj.stop_reason in ("stop", "eos") and isinstance(json.loads(obj.text), dict)
    date = _generate(engine, StructuredOutput.regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text) and date.stop_reason == "stop"
    pick = _generate(engine, StructuredOutput.choice(["yes", "no", "maybe so"]))
    assert pick.text in ("yes", "no", "maybe so")
    lark = _generate(engine, StructuredOutput.grammar('start: "A" NUM\nNUM: /[0-9]{2}/'))
    assert re.fullmatch(r"A[0-9]{2}", lark.text)


def test_sampled_constrained_output_validates_too(engine):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    for seed in range(3):
        turn = _generate(engine, StructuredOutput.json_schema(schema), temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(turn.text), schema)


def test_an_unconstrained_request_in_the_same_batch_is_unchanged(engine):
    alone = engine.session()
    alone.append(ASK)
    want = alone.generate("plan", max_new_tokens=12, temperature=0.0)
    s1, s2 = engine.session(), engine.session()
    s1.append(ASK)
    s2.append(ASK)
    free = s1.submit("plan", max_new_tokens=12, temperature=0.0)
    bound = s2.submit(
        "plan", max_new_tokens=300, temperature=0.0, structured_output=StructuredOutput.json_object()
    )
    got, constrained = engine.wait_all([free, bound])
    assert got.token_ids == want.token_ids
    assert constrained.stop_reason == "stop" and isinstance(json.loads(constrained.text), dict)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput.json_schema('{"type": "object", "properties": 5}'),
        StructuredOutput.regex("(unclosed"),
        StructuredOutput.grammar("start: undefined_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_before_anything_runs(engine, spec):
    s = engine.session()
    s.append(ASK)
    with pytest.raises(StructuredOutputError, match=spec.kind):
        s.submit("plan", structured_output=spec)
    assert s.token_ids[-1] == engine.encode(ASK)[-1]  # nothing ran


def test_the_server_honours_response_format_and_vllms_fields(engine):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    with live(engine, model_name="smol") as (server, client):
        got = client.chat.completions.create(
            model="plan",
            messages=messages,
            max_tokens=80,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema, "strict": True},
            },
        )
        jsonschema.validate(json.loads(got.choices[0].message.content), schema)
        # the base model (the plan adapter nests objects without end on an open-ended object)
        short = [
            {"role": "user", "content": 'Answer with a JSON object {"capital": ...}: the capital of France?'}
        ]
        obj = client.chat.completions.create(
            model="smol",
            messages=short,
            max_tokens=200,
            temperature=0,
            response_format={"type": "json_object"},
            extra_body={"cache_salt": "json-object"},  # its own tenant: no cache written by the plan adapter
        )
        assert obj.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
        pick = client.completions.create(
            model="plan",
            prompt="Is the sky blue?",
            max_tokens=5,
            temperature=0,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        assert pick.choices[0].text in ("yes", "no")
        regex = client.completions.create(
            model="plan",
            prompt="Year:",
            max_tokens=8,
            temperature=0,
            extra_body={"structured_outputs": {"regex": "[0-9]{4}"}},
        )
        assert re.fullmatch("[0-9]{4}", regex.choices[0].text)
        for body, field in [
            ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "guided_choice"),
            ({"guided_regex": "(unclosed"}, "guided_regex"),
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                "response_format.json_schema.schema",
            ),
            ({"response_format": {"type": "yaml"}}, "response_format.type"),
            ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
            ({"guided_regex": "foo**"}, "guided_regex"),  # the grammar engine takes it, Python's re does not
            ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema"),
        ]:
            r = httpx.post(
                f"{server.url}/completions", json={"model": "plan", "prompt": "Hi", **body}, timeout=60
            )
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == field, r.text
