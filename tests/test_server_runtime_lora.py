"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on a live server (loopback, tiny model):
an adapter loaded into a running server answers the next request under every sharing method, its
first token's log-probabilities equal to NonShared's; vLLM's request and answer shapes; every
refusal with its status."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import precache
from precache.methods import METHODS
from tests.test_server_support import BASE, check_all_sessions, live, tiny_with_tokenizer


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/{path}", json=body, timeout=60)


def completion(server, model: str, prompt, **extra) -> dict:
    r = post(server, "completions", {"model": model, "prompt": prompt, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def engines(tiny):
    model, dirs, _ = tiny
    return tiny_with_tokenizer(model), dirs


@pytest.mark.parametrize("method", METHODS)
def test_an_adapter_loaded_at_run_time_answers_the_next_request(engines, method):
    model, dirs = engines
    engine = precache.Engine(
        model, adapters={"plan": dirs["plan"]}, method=method, max_adapters=2, max_lora_rank=8
    )
    with live(engine, runtime_lora=True) as (server, _):
        prompt = list(range(3, 30))
        first = completion(server, "plan", prompt, max_tokens=4, return_token_ids=True)
        r = post(server, "load_lora_adapter", {"lora_name": "reflect", "lora_path": str(dirs["reflect"])})
        assert r.status_code == 200, r.text
        assert r.text == "Success: LoRA adapter 'reflect' added successfully."
        assert "reflect" in [m["id"] for m in httpx.get(f"{server.url}/models").json()["data"]]
        # the conversation goes on with the new adapter: its caches are built for it (catch-up)
        continued = prompt + first["choices"][0]["token_ids"] + [40, 41, 42]
        completion(server, "reflect", continued, max_tokens=3)
        # a new trajectory: its first token's log-probabilities are NonShared's
        fresh = list(range(50, 70))
        got = completion(server, "reflect", fresh, max_tokens=1, logprobs=5)
        check_all_sessions(server)
    nonshared = precache.Engine(model, adapters={"reflect": dirs["reflect"]}, method="nonshared")
    s = nonshared.session()
    s.append(fresh)
    want = torch.log_softmax(s.generate(agent="reflect", max_new_tokens=1, temperature=0.0).first_logits, -1)
    top = got["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) == 5
    for text, lp in top.items():
        token = nonshared.encode(text)
        assert len(token) == 1 and math.isclose(lp, want[token[0]].item(), abs_tol=1e-4)


@pytest.fixture(scope="module")
def runtime_server(engines):
    model, dirs = engines
    engine = precache.Engine(model, adapters={"plan": dirs["plan"]}, method="prelrshared", max_adapters=2)
    with live(engine, runtime_lora=True) as (server, _):
        yield server, dirs


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "lora_path"),
        ({"lora_name": BASE, "lora_path": "."}, 400, "lora_name"),
        ({"lora_name": "", "lora_path": "."}, 400, "lora_name"),
        ({"lora_name": "a" * 300, "lora_path": "."}, 400, "lora_name"),
        ({"lora_name": "plan", "lora_path": "."}, 400, "lora_name"),
        ({"lora_name": "x", "lora_path": ".", "load_inplace": True}, 400, "load_inplace"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": ".", "extra": 1}, 400, "extra"),
    ],
)
def test_bad_loads_are_refused_with_the_field(runtime_server, body, status, param):
    server, _ = runtime_server
    r = post(server, "load_lora_adapter", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"]


def test_unload_refuses_unknown_and_busy_adapters_and_the_name_is_gone_after(runtime_server):
    server, dirs = runtime_server
    r = post(server, "unload_lora_adapter", {"lora_name": "nobody"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    assert (
        post(server, "load_lora_adapter", {"lora_name": "act", "lora_path": str(dirs["action"])}).status_code
        == 200
    )
    # a second adapter does not fit: the one spare LR slot is taken
    r = post(server, "load_lora_adapter", {"lora_name": "more", "lora_path": str(dirs["reflect"])})
    assert r.status_code == 400 and "--max-loras" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "no_adapter_slot"
    # hold the server loop so that a request of "act" is queued when the unload arrives
    loop, entered, gate = server.app.state.loop, threading.Event(), threading.Event()
    loop.call(lambda pool: (entered.set(), gate.wait(30)))
    # the loop thread has taken the hold out of its inbox: from here the inbox counts only the two
    # requests below (without this wait, the hold itself could pass for the completion)
    assert entered.wait(30)
    with ThreadPoolExecutor(2) as pool:
        answer = pool.submit(completion, server, "act", [5, 6, 7], max_tokens=3)
        deadline = time.monotonic() + 30
        while loop._inbox.qsize() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        unload = pool.submit(post, server, "unload_lora_adapter", {"lora_name": "act"})
        while loop._inbox.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        r = unload.result()
        assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_in_use"
        assert len(answer.result()["choices"][0]["text"]) > 0  # the request ran with its adapter
    r = post(server, "unload_lora_adapter", {"lora_name": "act"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'act' removed successfully."
    assert "act" not in [m["id"] for m in httpx.get(f"{server.url}/models").json()["data"]]
    r = post(server, "completions", {"model": "act", "prompt": [5, 6], "max_tokens": 1})
    assert r.status_code == 404
    # its slot is free again
    r = post(server, "load_lora_adapter", {"lora_name": "more", "lora_path": str(dirs["reflect"])})
    assert r.status_code == 200
    completion(server, "more", [5, 6, 7], max_tokens=2)


def test_the_routes_exist_only_when_enabled(engines):
    model, dirs = engines
    with live(precache.Engine(model, adapters={"plan": dirs["plan"]})) as (server, _):
        r = post(server, "load_lora_adapter", {"lora_name": "x", "lora_path": str(dirs["action"])})
        assert r.status_code == 404
