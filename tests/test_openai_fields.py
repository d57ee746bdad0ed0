"""Every request field of the OpenAI-compatible server is honoured (equal to the library, whose
sampling is checked against HF in test_sampling.py) or refused with a 400 that names it: ``n``
on forks of one prefill, logprobs in the OpenAI shapes, penalties, logit_bias, min_tokens,
stop_token_ids, echo, the chat-template options, context overflow, unknown and ignored fields."""

from __future__ import annotations

import json

import httpx
import pytest

from precache.server.fields import REFUSED
from tests.test_server_support import char_tokenizer, live, tiny_engine

PROMPT = "Once upon a time, in a castle"


@pytest.fixture(scope="module")
def served(tiny):
    with live(tiny_engine(tiny, "prelrshared")) as (server, client):
        yield server, client


@pytest.fixture(scope="module")
def offline(tiny):
    return tiny_engine(tiny, "prelrshared")


def _offline(engine, ids, agent="plan", **kwargs):
    s = engine.session()
    s.append(ids)
    return s.generate(agent=agent, **{"temperature": 0.0, **kwargs})


def _post(server, path, body):
    return httpx.post(f"{server.url}/{path}", json=body, timeout=60)


def _chat_body(**fields):
    return {"model": "plan", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3, **fields}


def _completion_body(**fields):
    return {"model": "plan", "prompt": PROMPT, "max_tokens": 3, **fields}


def _assert_refused(r, field):
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert isinstance(error["code"], str) and error["code"]  # every 400 carries a code


# -- refused -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", sorted(REFUSED))
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_every_refused_vllm_field_is_a_400_naming_it(served, field, path):
    server, _ = served
    body = (_chat_body if path.startswith("chat") else _completion_body)(**{field: {"bogus": 1}})
    _assert_refused(_post(server, path, body), field)
    noop = REFUSED[field][0][0]  # its no-op value is accepted
    ok = _post(server, path, (_chat_body if path.startswith("chat") else _completion_body)(**{field: noop}))
    assert ok.status_code == 200, ok.text


REFUSED_VALUES = [
    ("completions", {"frobnicate": 1}, "frobnicate"),
    ("chat/completions", {"temperaturee": 0.5}, "temperaturee"),
    ("chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    (
        "completions",
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format.json_schema.schema",
    ),
    # the test tokenizer (one word-level token per character) is one llguidance cannot read
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("completions", {"guided_regex": "[0-9]+"}, "guided_regex"),
    ("chat/completions", {"tool_choice": "auto"}, "tool_choice"),  # tool_choice without tools
    ("completions", {"tool_choice": "required"}, "tool_choice"),
    ("completions", {"best_of": 3}, "best_of"),
    ("chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("completions", {"logprobs": 50}, "logprobs"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),
    ("chat/completions", {"echo": True, "logprobs": True}, "echo"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5000": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("completions", {"stop_token_ids": [5000]}, "stop_token_ids"),
    ("completions", {"min_tokens": 9}, "min_tokens"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"frequency_penalty": 3}, "frequency_penalty"),
    ("completions", {"presence_penalty": -3}, "presence_penalty"),
    ("completions", {"min_p": 2}, "min_p"),
    ("completions", {"n": 0}, "n"),
    ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ("completions", {"stop": [""]}, "stop"),  # vLLM: "stop cannot contain an empty string"
    ("chat/completions", {"stop": ["ok", ""]}, "stop"),
    ("completions", {"logit_bias": {"05": 1}}, "logit_bias"),  # one spelling per token id
    ("completions", {"logit_bias": {" 5": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"\uff15": 1}}, "logit_bias"),  # a full-width 5
    ("completions", {"logit_bias": {"+5": 1}}, "logit_bias"),
    ("completions", {"session_id": "s" * 257}, "session_id"),
    ("chat/completions", {"request_id": "r" * 257}, "request_id"),
    ("completions", {"prompt": [True, False]}, "prompt[0]"),  # booleans are not token ids
    ("completions", {"stop_token_ids": [True]}, "stop_token_ids[0]"),
]


@pytest.mark.parametrize(("path", "fields", "param"), REFUSED_VALUES)
def test_refused_values_name_their_field(served, path, fields, param):
    server, _ = served
    body = (_chat_body if path.startswith("chat") else _completion_body)(**fields)
    _assert_refused(_post(server, path, body), param)


def test_ignored_fields_are_accepted(served):
    server, _ = served
    body = _completion_body(user="alice", metadata={"a": "b"}, store=False, temperature=0)
    r = _post(server, "completions", body)
    assert (
        r.status_code == 200
        and r.json()["choices"][0]["text"]
        == _post(server, "completions", _completion_body(temperature=0)).json()["choices"][0]["text"]
    )


def test_a_prompt_plus_max_tokens_past_the_context_is_a_400(served):
    server, _ = served
    prompt = "x" * 200
    r = _post(server, "completions", {"model": "plan", "prompt": prompt, "max_tokens": 57})
    _assert_refused(r, "max_tokens")
    assert "257" in r.json()["error"]["message"]
    assert (
        _post(server, "completions", {"model": "plan", "prompt": prompt, "max_tokens": 56}).status_code == 200
    )
    r = _post(server, "chat/completions", _chat_body(max_tokens=None, max_completion_tokens=250))
    _assert_refused(r, "max_completion_tokens")
    r = _post(server, "completions", {"model": "plan", "prompt": "x" * 245})  # the default 16 does not fit
    _assert_refused(r, "max_tokens")


# -- honoured --------------------------------------------------------------------------------------
def _counting_forward(server):
    engine = server.app.state.engine
    forward, counts = engine.scheduler.forward, []

    def counting(plans):
        counts.append(sum(len(p.token_ids) for p in plans))
        return forward(plans)

    engine.scheduler.forward = counting
    return counts, lambda: setattr(engine.scheduler, "forward", forward)


def test_n_choices_share_one_prefill(served, offline):
    server, client = served
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    want = _offline(offline, prompt, max_new_tokens=5, ignore_eos=True)
    counts, restore = _counting_forward(server)
    try:
        got = client.completions.create(
            model="plan", prompt=prompt, max_tokens=5, temperature=0, n=3, extra_body={"ignore_eos": True}
        )
    finally:
        restore()
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [want.text] * 3
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == 15
    # one prefill of the prompt, whose logits give every choice its first token; then the three
    # choices decode their other 4 tokens in the same forwards (one row each)
    assert counts == [len(prompt)] + [3] * 4


def test_n_choices_stream_by_index(served, offline):
    _, client = served
    want = _offline(offline, offline.encode(PROMPT), max_new_tokens=6, ignore_eos=True)
    stream = client.completions.create(
        model="plan",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, finished = {0: "", 1: ""}, set()
    chunks = list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == {0: want.text, 1: want.text} and finished == {0, 1}
    assert chunks[-1].usage.completion_tokens == 12


def test_seeded_sampling_with_min_p_and_top_k_equals_the_library(served, offline):
    _, client = served
    fields = dict(temperature=1.0, top_p=0.9, seed=11)
    extra = dict(min_p=0.05, top_k=20, ignore_eos=True)
    want = _offline(offline, offline.encode(PROMPT), max_new_tokens=10, **fields, **extra)
    got = client.completions.create(model="plan", prompt=PROMPT, max_tokens=10, **fields, extra_body=extra)
    assert got.choices[0].text == want.text


@pytest.mark.parametrize(
    "extra",
    [
        {"repetition_penalty": 1.6, "ignore_eos": True},
        {"frequency_penalty": 1.2, "presence_penalty": 0.5, "ignore_eos": True},
        {"logit_bias": {"20": 8.0}, "ignore_eos": True},
        {"min_tokens": 5},
        {"ignore_eos": True, "skip_special_tokens": False},
    ],
)
def test_sampling_fields_equal_the_library(served, offline, extra):
    _, client = served
    library = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in extra.items()}
    want = _offline(offline, offline.encode(PROMPT), max_new_tokens=10, **library)
    plain = _offline(offline, offline.encode(PROMPT), max_new_tokens=10, ignore_eos=True)
    body = {k: v for k, v in extra.items() if k in ("logit_bias", "frequency_penalty", "presence_penalty")}
    rest = {k: v for k, v in extra.items() if k not in body}
    got = client.completions.create(
        model="plan",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True, **rest},
        **body,
    )
    assert got.choices[0].token_ids == want.token_ids and got.choices[0].text == want.text
    if "min_tokens" not in extra and "skip_special_tokens" not in extra:
        assert want.token_ids != plain.token_ids


def test_stop_token_ids_end_the_answer_without_their_text(served, offline):
    _, client = served
    plain = _offline(offline, offline.encode(PROMPT), max_new_tokens=10, ignore_eos=True)
    stop_id = plain.token_ids[3]
    want = _offline(
        offline, offline.encode(PROMPT), max_new_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]
    )
    got = client.completions.create(
        model="plan",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    i = plain.token_ids.index(stop_id)
    assert got.choices[0].text == want.text == offline.decode(plain.token_ids[:i])
    assert got.choices[0].finish_reason == "stop" and got.choices[0].stop_reason == stop_id


def test_chat_logprobs_in_the_openai_shape_streamed_or_not(served, offline):
    _, client = served
    messages = [{"role": "user", "content": "Pick a word."}]
    ids = offline.encode(
        char_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    want = _offline(offline, ids, max_new_tokens=5, ignore_eos=True, logprobs=3)
    got = client.chat.completions.create(
        model="plan",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = got.choices[0].logprobs.content
    assert [c.token for c in content] == [offline.decode([e.token_id]) for e in want.logprobs]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    assert [[t.token for t in c.top_logprobs] for c in content] == [
        [offline.decode([i]) for i, _ in e.top] for e in want.logprobs
    ]
    assert content[0].bytes == list(content[0].token.encode())
    stream = client.chat.completions.create(
        model="plan",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [c for chunk in stream for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx(
        [c.logprob for c in content], abs=1e-5
    )  # cached prompt


def test_completion_logprobs_and_echo(served, offline):
    _, client = served
    want = _offline(offline, offline.encode(PROMPT), max_new_tokens=4, ignore_eos=True, logprobs=2)
    got = client.completions.create(
        model="plan", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = got.choices[0].logprobs
    assert lp.tokens == [offline.decode([e.token_id]) for e in want.logprobs]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    assert [len(t) for t in lp.top_logprobs] == [2] * 4
    assert lp.text_offset == [0, 1, 2, 3]  # one character per token
    echoed = client.completions.create(
        model="plan", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    assert echoed.choices[0].text == PROMPT + want.text
    stream = client.completions.create(
        model="plan",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        echo=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == PROMPT + want.text


def _render(messages, **options):
    return char_tokenizer().apply_chat_template(messages, tokenize=False, **options)


def test_chat_template_options_reach_the_template(served, offline):
    _, client = served
    messages = [{"role": "user", "content": "Hello"}]
    cases = [
        (
            {"chat_template_kwargs": {"hint": "Be terse."}},
            _render(messages, add_generation_prompt=True, hint="Be terse."),
        ),
        ({"add_generation_prompt": False}, _render(messages)),
        (
            {"documents": [{"title": "t", "text": "Paris is in France."}]},
            _render(
                messages,
                add_generation_prompt=True,
                documents=[{"title": "t", "text": "Paris is in France."}],
            ),
        ),
    ]
    for extra, text in cases:
        ids = offline.encode(text)
        want = _offline(offline, ids, max_new_tokens=4, ignore_eos=True)
        got = client.chat.completions.create(
            model="plan",
            messages=messages,
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )
        assert got.usage.prompt_tokens == len(ids) and got.choices[0].message.content == want.text, extra


def test_continue_final_message_and_chat_echo(served, offline):
    _, client = served
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two"}]
    text = _render(messages, continue_final_message=True)
    assert text.endswith("one, two")
    want = _offline(offline, offline.encode(text), max_new_tokens=4, ignore_eos=True)
    got = client.chat.completions.create(
        model="plan",
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={
            "ignore_eos": True,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
        },
    )
    assert got.choices[0].message.content == "one, two" + want.text


def test_request_id_and_max_completion_tokens(served):
    _, client = served
    got = client.chat.completions.create(
        model="plan",
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=7,
        max_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True, "request_id": "abc123"},
    )
    assert got.id == "chatcmpl-abc123" and got.usage.completion_tokens == 7


def test_a_long_model_name_is_quoted_only_in_part(served):
    server, _ = served
    r = _post(server, "completions", {**_completion_body(), "model": "m" * 100_000})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and len(error["message"]) < 400
    assert "100002 characters" in error["message"]  # the quoted repr's length is said


def test_a_temperature_that_underflows_samples_greedily(served, offline):
    server, client = served
    ids = offline.encode(PROMPT)
    want = _offline(offline, ids, max_new_tokens=6).text
    for t in (1e-300, 5e-6):
        r = _post(server, "completions", _completion_body(prompt=ids, max_tokens=6, temperature=t))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want


def test_chat_logprobs_bytes_are_each_tokens_own_bytes(served):
    server, _ = served
    r = _post(
        server, "chat/completions", _chat_body(logprobs=True, top_logprobs=2, max_tokens=5, temperature=0)
    )
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    # one token per character (the test tokenizer): a token's bytes are its character's UTF-8
    for entry in content:
        assert bytes(entry["bytes"]) == entry["token"].encode("utf-8")
        for top in entry["top_logprobs"]:
            assert bytes(top["bytes"]) == top["token"].encode("utf-8")


# -- several prompts in one /v1/completions request ----------------------------------------------
PROMPTS = ["Once upon a time", "In a castle far", "The knight said"]


def test_a_list_of_prompts_answers_n_choices_per_prompt_in_openai_order(served, offline):
    server, _ = served
    body = _completion_body(prompt=PROMPTS, n=2, max_tokens=5, temperature=0, ignore_eos=True)
    r = _post(server, "completions", body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert [c["index"] for c in got["choices"]] == list(range(6))
    for i, prompt in enumerate(PROMPTS):
        want = _offline(offline, offline.encode(prompt), max_new_tokens=5, ignore_eos=True).text
        assert [got["choices"][2 * i + j]["text"] for j in range(2)] == [want, want]
    lengths = [len(offline.encode(p)) for p in PROMPTS]
    assert got["usage"]["prompt_tokens"] == sum(lengths)
    assert got["usage"]["completion_tokens"] == 6 * 5
    assert len(got["session_ids"]) == 3


def test_a_list_of_token_id_prompts_streams_each_choice_by_index(served, offline):
    server, _ = served
    prompts = [offline.encode(p) for p in PROMPTS[:2]]
    body = _completion_body(prompt=prompts, max_tokens=4, temperature=0, ignore_eos=True, stream=True)
    body["stream_options"] = {"include_usage": True}
    texts: dict[int, str] = {}
    usage = None
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            usage = chunk.get("usage") or usage
    for i, ids in enumerate(prompts):
        assert texts[i] == _offline(offline, ids, max_new_tokens=4, ignore_eos=True).text
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)


def test_the_openai_client_sends_a_batch_of_prompts(served, offline):
    _, client = served
    got = client.completions.create(model="plan", prompt=PROMPTS, max_tokens=3, temperature=0)
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    for c in got.choices:
        assert c.text == _offline(offline, offline.encode(PROMPTS[c.index]), max_new_tokens=3).text


@pytest.mark.parametrize(
    "fields", [{"echo": True}, {"return_token_ids": True}, {"session_id": "s1"}, {"n": 100}]
)
def test_fields_that_name_one_prompt_are_refused_with_several(served, fields):
    server, _ = served
    r = _post(server, "completions", _completion_body(prompt=PROMPTS, **fields))
    field = next(iter(fields))
    _assert_refused(r, "prompt" if field == "n" else field)
