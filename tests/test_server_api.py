"""The OpenAI-compatible API against a live server on loopback, with the official ``openai`` client:
completions and chat, streamed and not, greedy outputs equal to the offline engine, stop strings,
every bad request with its status code, client disconnects, /health, /metrics, /v1/models."""

from __future__ import annotations

import logging
import time

import httpx
import openai
import pytest

from tests.test_server_support import BASE, char_tokenizer, check_all_sessions, live, tiny_engine, wait_idle

MAX_CONTEXT = 256  # the tiny model's


@pytest.fixture(scope="module")
def served(tiny):
    with live(tiny_engine(tiny, "prelrshared")) as (server, client):
        yield server, client


@pytest.fixture(scope="module")
def offline(tiny):
    """The same model, adapters and method as the server, for reference generations."""
    return tiny_engine(tiny, "prelrshared")


def _offline(engine, ids, agent, n, **kwargs):
    s = engine.session()
    s.append(ids)
    return s.generate(agent=agent, max_new_tokens=n, temperature=0.0, **kwargs)


def _stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(
        (c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
        for c in chunks
        if c.choices
    )
    return text, chunks


def test_models_lists_the_base_model_and_every_adapter(served):
    _, client = served
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [BASE, "plan", "action", "reflect"]
    assert cards["plan"].parent == BASE and cards[BASE].parent is None


@pytest.mark.parametrize("model", ["plan", BASE])
def test_completion_greedy_equals_the_offline_engine_streamed_or_not(served, offline, model):
    _, client = served
    prompt = f"Question {model}: where is the Eiffel tower?"
    agent = None if model == BASE else model
    want = _offline(offline, offline.encode(prompt), agent, 8)
    got = client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    assert got.choices[0].token_ids == want.token_ids
    assert got.choices[0].text == want.text  # the OpenAI rule: no EOS text, special tokens skipped
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == len(want.token_ids)
    text, chunks = _stream_text(
        client.completions.create(model=model, prompt=prompt + "!", max_tokens=8, temperature=0, stream=True)
    )
    want2 = _offline(offline, offline.encode(prompt + "!"), agent, 8)
    assert text == want2.text
    assert chunks[-1].choices[0].finish_reason == ("stop" if want2.stop_reason == "eos" else "length")


def test_completion_accepts_token_ids(served, offline):
    _, client = served
    ids = [5, 17, 33, 60, 61, 62, 40, 41]
    got = client.completions.create(
        model="action", prompt=ids, max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
    )
    assert got.choices[0].token_ids == _offline(offline, ids, "action", 5).token_ids


def test_chat_uses_the_template_and_equals_the_offline_engine(served, offline):
    _, client = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    text = char_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = offline.encode(text)
    want = _offline(offline, ids, "reflect", 6)
    want_text = want.text
    got = client.chat.completions.create(model="reflect", messages=messages, max_tokens=6, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want_text
    assert got.usage.prompt_tokens == len(ids)
    streamed, chunks = _stream_text(
        client.chat.completions.create(
            model="reflect",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed == want_text and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # same prompt again


def test_stop_strings_end_the_answer_and_are_not_returned(served, offline):
    _, client = served
    prompt = "Tell me a story about a cat."
    full = _offline(offline, offline.encode(prompt), "plan", 12, ignore_eos=True).text
    stop = full[4:6]
    assert len(stop) == 2 and full.find(stop) == 4
    want = _offline(offline, offline.encode(prompt), "plan", 12, stop=[stop])
    assert (
        want.text == full[:4]
        and want.matched_stop == stop
        and want.text + want.trimmed == full[: len(want.text + want.trimmed)]
    )
    got = client.completions.create(model="plan", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].text == full[:4] and got.choices[0].finish_reason == "stop"
    assert got.choices[0].stop_reason == stop  # vLLM's field: the stop string that ended the answer
    text, _ = _stream_text(
        client.completions.create(
            model="plan", prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True
        )
    )
    assert text == full[:4]


BAD_REQUESTS = [
    ({"model": "planner", "prompt": "hi"}, 404, "model"),
    ({"model": "plan", "prompt": "x" * (MAX_CONTEXT + 4)}, 400, "prompt"),
    ({"model": "plan", "prompt": "x" * MAX_CONTEXT}, 400, "prompt"),  # no room for one token
    ({"model": "plan", "prompt": ""}, 400, "prompt"),
    ({"model": "plan", "prompt": []}, 400, "prompt"),
    ({"model": "plan", "prompt": [5, 999]}, 400, "prompt"),  # not a token id of this model
    ({"model": "plan", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "plan", "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"model": "plan", "prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ({"model": "plan"}, 400, "prompt"),  # missing field
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(served, body, status, param):
    server, client = served
    r = httpx.post(f"{server.url}/completions", json=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]
    assert client.completions.create(model="plan", prompt="ok", max_tokens=2).usage.completion_tokens >= 1


def test_malformed_json_and_bad_chat_requests_are_400(served):
    server, client = served
    r = httpx.post(f"{server.url}/chat/completions", content=b'{"model": "plan", "messages": [', timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="plan", messages=[], max_tokens=2)
    assert err.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(f"{server.url}/nothing-here", timeout=30).json()["error"]["code"] == "not_found"
    assert client.chat.completions.create(
        model="plan", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )


def _slow_model(server, delay_s: float):
    """Make every forward of the served model sleep ``delay_s`` seconds (0: restore)."""
    model = server.app.state.engine.model
    if not delay_s:
        del model.forward
        return
    forward = type(model).forward

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return forward(model, *args, **kwargs)

    model.forward = slow


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_request_and_frees_the_session(served, stream):
    server, client = served
    prompt = [7] * 8 + [11, 12, 13, 14] + [int(stream)]
    body = {"model": "plan", "prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": stream}
    body["ignore_eos"] = True
    _slow_model(server, 0.02)
    try:
        if stream:
            with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                next(line for line in r.iter_lines() if line.startswith("data:"))  # first token, then leave
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.url}/completions", json=body, timeout=0.3)
        sessions = wait_idle(server)
    finally:
        _slow_model(server, 0)
    mine = [ids for ids, _ in sessions if ids[: len(prompt)] == prompt]
    assert len(mine) == 1 and len(prompt) < len(mine[0]) < len(prompt) + 100  # cut short
    assert not any(busy for _, busy in sessions)
    assert 'precache_requests_total{outcome="cancelled"}' in httpx.get(server.url[:-3] + "/metrics").text
    check_all_sessions(server)
    assert client.completions.create(model="plan", prompt=prompt, max_tokens=2, temperature=0).choices


def test_health_and_metrics(served):
    server, client = served
    root = server.url[: -len("/v1")]
    assert httpx.get(f"{root}/health").json() == {"status": "ok", "method": "prelrshared"}
    client.completions.create(model="action", prompt="metrics please", max_tokens=3, temperature=0)
    text = httpx.get(f"{root}/metrics").text
    for name in [
        'precache_time_to_first_token_seconds_count{model="action"}',
        'precache_request_latency_seconds_count{model="action"}',
        "precache_cached_token_ratio",
        "precache_kv_cache_bytes",
        "precache_batch_requests_count",
    ]:
        assert name in text
    cache_bytes = next(line for line in text.splitlines() if line.startswith("precache_kv_cache_bytes "))
    assert float(cache_bytes.split()[1]) > 0


def test_each_request_gets_one_access_line_by_default(served, caplog):
    server, _ = served
    with caplog.at_level(logging.INFO, logger="precache.server.access"):
        body = {"model": "plan", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{server.url}/completions", json=body, timeout=60).status_code == 200
        with httpx.stream(
            "POST", f"{server.url}/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            list(r.iter_lines())
        assert (
            httpx.post(f"{server.url}/completions", json={**body, "model": "nope"}, timeout=60).status_code
            == 404
        )
        httpx.get(f"{server.url.removesuffix('/v1')}/health", timeout=10)
    lines = [r.getMessage() for r in caplog.records if r.name == "precache.server.access"]
    done = [line for line in lines if line.startswith("POST /v1/completions 200")]
    assert len(done) == 2, lines
    for line in done:
        assert "model=plan" in line and "completion=3" in line and "ttft=" in line and "ttft=-" not in line
    assert any(line.startswith("POST /v1/completions 404") for line in lines)
    assert not any("/health" in line for line in lines)
