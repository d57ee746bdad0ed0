"""The server under a block pool far smaller than its load: the engine preempts (swap) oldest first,
so every request completes with the greedy tokens it gets alone, streams included, and no 5xx;
``n`` choices come back from one engine request."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx

import precache
from tests.test_server_support import live, tiny_with_tokenizer

AGENTS = ("plan", "action", "reflect")


def _prompt(k: int) -> list[int]:
    rng = random.Random(k)
    return [rng.randrange(3, 95) for _ in range(90 + rng.randrange(0, 20))]


def _alone(model, dirs, agent: str, prompt: list[int], n: int) -> list[int]:
    engine = precache.Engine(model, adapters=dirs, method="prelrshared", prefix_caching=False)
    s = engine.session()
    s.append(prompt)
    return s.generate(agent, max_new_tokens=n, temperature=0.0, ignore_eos=True).token_ids


def test_sixteen_requests_on_a_76_block_pool_all_complete_with_their_alone_tokens(tiny):
    model, dirs, _ = tiny
    model = tiny_with_tokenizer(model)
    probe = precache.Engine(model, adapters=dirs, method="prelrshared", kv_cache_bytes=1 << 24)
    engine = precache.Engine(
        model, adapters=dirs, method="prelrshared", kv_cache_bytes=76 * probe.pool.block_bytes
    )
    assert engine.pool.num_blocks == 76
    max_tokens = 60

    def ask(k: int) -> tuple[list[int], int]:
        body = {"ignore_eos": True, "cache_salt": f"tenant-{k}", "return_token_ids": True}
        if k % 2:  # streamed: the client only waits while its request is preempted
            with httpx.stream(
                "POST",
                f"{url}/completions",
                json={
                    "model": AGENTS[k % 3],
                    "prompt": _prompt(k),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                    **body,
                },
                timeout=300,
            ) as r:
                ids, status = [], r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
                return ids, status
        r = client.completions.create(
            model=AGENTS[k % 3], prompt=_prompt(k), max_tokens=max_tokens, temperature=0, extra_body=body
        )
        return list(r.choices[0].token_ids), 200

    with live(engine) as (server, client):
        url = server.url
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(ask, range(16)))
        metrics = httpx.get(server.url[:-3] + "/metrics").text
    assert engine.scheduler.preemptions > 0  # 16 x ~11 blocks never fit 76 at once
    assert [status for _, status in results] == [200] * 16
    assert 'precache_requests_total{outcome="error"}' not in metrics
    for k, (ids, _) in enumerate(results):
        assert ids == _alone(model, dirs, AGENTS[k % 3], _prompt(k), max_tokens), k


def test_n_choices_come_from_one_request_and_equal_their_seeds_alone(tiny):
    model, dirs, _ = tiny
    model = tiny_with_tokenizer(model)
    engine = precache.Engine(model, adapters=dirs, method="prelrshared", prefix_caching=False)
    prompt = _prompt(99)
    with live(engine) as (_, client):
        r = client.completions.create(
            model="plan",
            prompt=prompt,
            max_tokens=8,
            temperature=1.0,
            seed=5,
            n=3,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, choice in enumerate(r.choices):
        s = precache.Engine(model, adapters=dirs, method="prelrshared", prefix_caching=False).session()
        s.append(prompt)
        want = s.generate("plan", max_new_tokens=8, temperature=1.0, seed=5 + i, ignore_eos=True)
        assert list(choice.token_ids) == want.token_ids
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(prompt)
