"""Tenant isolation and determinism inside a tenant (docs/security.md; docs/DESIGN.md,
"Determinism"): a tenant never reuses, nor learns about, another tenant's cache; a conversation
gives the same tokens alone and interleaved with another tenant's conversations, under every
method; a re-read of a cached prompt token never rewrites a shared entry; the base-model id is an
agent of its own; API keys (401) and salts combine into tenants; a bounded concurrent load over 3
tenants has no 5xx and no cross-tenant cache hit."""

from __future__ import annotations

import itertools
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import precache
from precache.cache.prefix import PrefixChain, common_prefix
from precache.methods import METHODS
from tests.test_server_support import BASE, check_all_sessions, live, tiny_engine, tiny_with_tokenizer

SYSTEM = [(5 * i + 7) % 88 + 4 for i in range(40)]  # a shared 40-token system prompt (2 full blocks)
TURNS = [("plan", [30, 31, 32], 4), ("action", [40, 41], 3), ("reflect", [50, 51, 52, 53], 3)]


def _complete(client, model, ids, n, salt=None):
    body = {"return_token_ids": True, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    return client.completions.create(model=model, prompt=ids, max_tokens=n, temperature=0, extra_body=body)


def _conversation(client, salt, head=(), turns=TURNS):
    """Run ``turns`` on ``SYSTEM + head``; return ``(token ids, cached tokens)`` per turn."""
    ids, out = [*SYSTEM, *head], []
    for agent, appended, n in turns:
        ids += appended
        r = _complete(client, agent, ids, n, salt)
        out.append((r.choices[0].token_ids, r.usage.prompt_tokens_details.cached_tokens))
        ids += r.choices[0].token_ids
    return out


@pytest.mark.parametrize("method", METHODS)
def test_a_conversation_is_the_same_alone_and_interleaved_with_another_tenant(tiny, method):
    with live(tiny_engine(tiny, method)) as (server, client):
        alone = _conversation(client, "tenant-x")
        check_all_sessions(server)
    with live(tiny_engine(tiny, method)) as (server, client):
        # the other tenant reads the same system prompt first, with other agents, and keeps going
        other = [_conversation(client, "tenant-y", head=[60 + i], turns=TURNS[::-1]) for i in range(2)]
        got, ids = [], list(SYSTEM)
        for step, (agent, appended, n) in enumerate(TURNS):
            ids += appended
            r = _complete(client, agent, ids, n, "tenant-x")
            got.append((r.choices[0].token_ids, r.usage.prompt_tokens_details.cached_tokens))
            ids += r.choices[0].token_ids
            _complete(client, TURNS[step - 1][0], [*SYSTEM, 70, 71, step], 2, "tenant-y")  # in between
        check_all_sessions(server)
    assert got == alone  # same tokens, same cached prompt tokens
    assert alone[0][1] == 0 and other[0][0][1] == 0  # each tenant's first request found nothing
    assert other[1][0][1] > 0 or method in ("nonshared", "baseshared")  # ... but its own tenant's


def _sessions(server):
    return server.app.state.loop.call(
        lambda pool: sorted((e.tenant or "", e.session.cache_salt or "") for e in pool.entries.values())
    ).result(30)


@pytest.mark.parametrize("method", METHODS)
def test_cached_tokens_never_count_another_tenants_prompt(tiny, method):
    prompt = [*SYSTEM, 9, 9, 9]
    with live(tiny_engine(tiny, method)) as (server, client):
        first = _complete(client, "plan", prompt, 2, "alice")
        by_salt = [_complete(client, "plan", prompt, 2, s) for s in ("bob", None, "alice")]
        _complete(client, "plan", prompt, 2)
        check_all_sessions(server)
        sessions = _sessions(server)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, *by_salt)]
    # bob and the default tenant start cold; alice's repeat finds her whole prompt but the last token
    assert cached == [0, 0, 0, len(prompt) - 1]
    assert by_salt[2].session_id == first.session_id and by_salt[0].session_id != first.session_id
    assert sessions == [("", ""), ("salt:alice", "salt:alice"), ("salt:bob", "salt:bob")]


def test_a_pinned_session_id_is_per_tenant(tiny):
    with live(tiny_engine(tiny, "prelrshared")) as (server, client):
        a = _complete(client, "plan", SYSTEM, 2, "alice")
        body = {"session_id": "shared-name", "return_token_ids": True, "cache_salt": "alice"}
        client.completions.create(model="plan", prompt=SYSTEM, max_tokens=2, extra_body=body)
        body["cache_salt"] = "bob"
        b = client.completions.create(model="plan", prompt=SYSTEM, max_tokens=2, extra_body=body)
        check_all_sessions(server)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens == 0  # bob's "shared-name" is his own session


def test_api_keys_authenticate_and_are_tenants_with_the_salt(tiny):
    with live(tiny_engine(tiny, "prelrshared"), api_keys=("key-a", "key-b")) as (server, _):
        root = server.url.removesuffix("/v1")
        with httpx.Client(base_url=root, timeout=60) as http:
            refused = [
                http.post("/v1/completions", json={"model": "plan", "prompt": [3, 4]}, headers=h)
                for h in ({}, {"authorization": "Bearer wrong"}, {"authorization": "key-a"})
            ]
            models = http.get("/v1/models")
            open_paths = [http.get("/health").status_code, http.get("/metrics").status_code]
        clients = {
            k: openai.OpenAI(base_url=server.url, api_key=k, max_retries=0, timeout=60)
            for k in ("key-a", "key-b")
        }
        prompt = [*SYSTEM, 8]
        cached = [
            _complete(clients[key], "plan", prompt, 2, salt).usage.prompt_tokens_details.cached_tokens
            for key, salt in [
                ("key-a", None),
                ("key-b", None),
                ("key-a", "s"),
                ("key-a", None),
                ("key-a", "s"),
            ]
        ]
        sessions = _sessions(server)
        for c in clients.values():
            c.close()
    for r in refused:
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert models.status_code == 401 and open_paths == [200, 200]
    assert cached == [0, 0, 0, len(prompt) - 1, len(prompt) - 1]
    assert len(sessions) == 3 and all(t.startswith("key:") and "key-a" not in t for t, _ in sessions)


REREAD = [*SYSTEM, 20, 21, 22]


@pytest.mark.parametrize("method", METHODS)
def test_a_reread_of_a_cached_prompt_never_rewrites_the_shared_entry(tiny, method):
    """plan, plan, action, plan on one prompt: the action request re-reads the prompt's last token
    and must not change plan's next answer. Where an agent's view of its own cached segment is its
    exact K/V (all but ReBaseShared, whose base is the neutral one), the re-read equals the first."""
    with live(tiny_engine(tiny, method)) as (server, client):
        answers = [
            _complete(client, a, REREAD, 5).choices[0].token_ids for a in ("plan", "plan", "action", "plan")
        ]
        check_all_sessions(server)
    assert answers[3] == answers[1]
    if not method.startswith("rebaseshared"):
        assert answers[1] == answers[0]


@pytest.mark.parametrize("method", METHODS)
def test_the_base_model_id_is_an_agent_of_its_own(tiny, method):
    """After adapter requests on a prompt, a base-model request reads the cache as the method
    defines: under NonShared (its own cache) and ReBaseShared (the neutral base) it equals the base
    model alone; under the others it reads what the first reader wrote, as the offline engine does
    on the same trajectory."""
    with live(tiny_engine(tiny, method)) as (_, client):
        for agent in ("plan", "action"):
            _complete(client, agent, REREAD, 3)
        after = _complete(client, BASE, REREAD, 5).choices[0].token_ids
    with live(tiny_engine(tiny, method)) as (_, client):
        alone = _complete(client, BASE, REREAD, 5).choices[0].token_ids
    engine = tiny_engine(tiny, method)
    engine.eos_token_ids = frozenset()  # as ignore_eos
    s = engine.session()
    for agent in ("plan", "action", None):
        s.sync(REREAD)
        turn = s.generate(agent=agent, max_new_tokens=3 if agent else 5, temperature=0.0)
    assert after == turn.token_ids
    if method in ("nonshared", "rebaseshared-lp", "rebaseshared-db"):
        assert after == alone


def test_32_concurrent_conversations_over_3_tenants_no_5xx_no_cross_tenant_hit(tiny):
    """Every tenant sends the same system prompt; a request's cached tokens never exceed what its
    own tenant could have cached (the longest common prefix with a trajectory of the same tenant
    whose request started before this one ended)."""
    rng = random.Random(0)
    tenants = ["t0", "t1", "t2"]
    plans = [(tenants[i % 3], [rng.randrange(3, 90) for _ in range(3)], i) for i in range(32)]
    clock = itertools.count()
    log = []  # (tenant, start, end, prompt, trajectory after, cached, status)

    def conversation(client, tenant, head, i):
        ids = [*SYSTEM, *head]
        for agent, appended, n in TURNS[: 2 + i % 2]:
            ids += appended
            start = next(clock)
            try:
                r = _complete(client, agent, ids, n, tenant)
            except openai.APIStatusError as exc:
                log.append((tenant, start, next(clock), list(ids), list(ids), 0, exc.status_code))
                return
            out = r.choices[0].token_ids
            log.append(
                (
                    tenant,
                    start,
                    next(clock),
                    list(ids),
                    ids + out,
                    r.usage.prompt_tokens_details.cached_tokens,
                    200,
                )
            )
            ids += out

    model, dirs, _ = tiny
    # the default block pool: 16 running conversations do not all fit, so requests that find it
    # full are preempted and queued again, never answered with a 5xx
    engine = precache.Engine(tiny_with_tokenizer(model), adapters=dirs, method="prelrshared")
    with live(engine, max_running=16) as (server, client):
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda p: conversation(client, *p), plans))
        assert check_all_sessions(server) >= 3
        assert server.app.state.loop.call(lambda pool: pool.check()).result(30) >= 3
    assert len(log) == sum(2 + i % 2 for i in range(32)) and {e[6] for e in log} == {200}
    for j, (tenant, _, end, prompt, _, cached, _) in enumerate(log):
        own = [e[4] for k, e in enumerate(log) if k != j and e[0] == tenant and e[1] < end]
        bound = max((common_prefix(prompt, t) for t in own), default=0)
        assert cached <= min(bound, len(prompt) - 1), (tenant, cached, bound)
    assert any(e[5] >= len(SYSTEM) - len(SYSTEM) % 16 for e in log)  # the tenants did share inside


@pytest.mark.parametrize("method", ["fullshared", "prelrshared", "rebaseshared-lp"])
def test_engine_prefix_blocks_are_reused_only_under_the_same_salt(tiny, method):
    """The engine alone: a session reuses blocks another session published for the same tokens
    only when both have the same ``cache_salt``; the chains of two salts share no hash."""
    engine = tiny_engine(tiny, method)
    prompt = [*SYSTEM, 11, 12]
    first = engine.session(cache_salt="a")
    first.append(prompt)
    first.generate(agent="plan", max_new_tokens=2, temperature=0.0)
    cached = {}
    for salt in ("b", None, "a"):
        s = engine.session(cache_salt=salt)
        s.append(prompt)
        cached[salt] = s.generate(agent="action", max_new_tokens=2, temperature=0.0).cached_tokens
    assert cached == {"b": 0, None: 0, "a": len(SYSTEM) - len(SYSTEM) % 16}
    chains = {salt: PrefixChain("base", salt=salt).extend(prompt, 2, 16) for salt in ("a", "b", None)}
    assert len({h for c in chains.values() for h in c}) == 6
    assert chains["a"] == PrefixChain("base", salt="a").extend(prompt, 2, 16)
    engine.pool.allocator.check()
