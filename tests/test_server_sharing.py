"""Cross-adapter prefix reuse through the server: one growing conversation over three adapters
(cached prompt tokens per method, outputs equal to the offline engine), unrelated conversations,
branches, pinned sessions, eviction, and a bounded concurrent load with integrity checks after."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import precache
from precache.methods import METHODS
from tests.test_server_support import check_all_sessions, live, tiny_engine

PROMPT = [(7 * i + 3) % 90 + 3 for i in range(30)]
TURNS = [("plan", [], 4), ("action", [40, 41, 42, 43, 44], 3), ("reflect", [50, 51, 52], 3)]
# prompt tokens the 2nd and 3rd turns find cached: everything but the previous turn's last token
# (no forward has read it), or nothing for methods where an agent re-reads what it has not seen
SHARED = [0, 30 + 4 - 1, 30 + 4 + 5 + 3 - 1]
NOT_SHARED = [0, 0, 0]


def _conversation(client, extra_body=None):
    """Run TURNS as completions on token ids; return the responses."""
    ids, out = list(PROMPT), []
    for agent, appended, n in TURNS:
        ids += appended
        body = {"return_token_ids": True, "ignore_eos": True, **(extra_body or {})}
        r = client.completions.create(model=agent, prompt=ids, max_tokens=n, temperature=0, extra_body=body)
        out.append(r)
        ids += r.choices[0].token_ids
    return out


def _offline_conversation(engine):
    engine.eos_token_ids = frozenset()  # as ignore_eos
    s = engine.session()
    s.append(PROMPT)
    turns = []
    for agent, appended, n in TURNS:
        s.append(appended)
        turns.append(s.generate(agent=agent, max_new_tokens=n, temperature=0.0))
    return turns


@pytest.mark.parametrize("method", METHODS)
def test_a_growing_conversation_over_three_adapters(tiny, method):
    with live(tiny_engine(tiny, method)) as (server, client):
        responses = _conversation(client)
        check_all_sessions(server)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in responses]
    assert cached == (NOT_SHARED if method in ("nonshared", "baseshared") else SHARED)
    assert len({r.session_id for r in responses}) == 1  # one trajectory, found by prefix alone
    want = _offline_conversation(tiny_engine(tiny, method))
    assert [r.choices[0].token_ids for r in responses] == [t.token_ids for t in want]


def test_unrelated_conversations_share_nothing_and_branches_do_not_cut_the_trunk(tiny):
    with live(tiny_engine(tiny, "prelrshared"), min_fork_tokens=16) as (server, client):
        first = _conversation(client)
        other = client.completions.create(model="plan", prompt=[80, 81, 82, 83], max_tokens=2, temperature=0)
        assert (
            other.usage.prompt_tokens_details.cached_tokens == 0 and other.session_id != first[0].session_id
        )
        # a branch: shares the first 20 tokens, then differs: its prefix is copied, the trunk stays
        branch = client.completions.create(
            model="action", prompt=PROMPT[:20] + [5, 5], max_tokens=2, temperature=0
        )
        assert (
            branch.usage.prompt_tokens_details.cached_tokens == 20
            and branch.session_id != first[0].session_id
        )
        trunk = _trajectory(first)
        again = client.completions.create(model="plan", prompt=trunk + [9], max_tokens=2, temperature=0)
        assert again.session_id == first[0].session_id
        assert again.usage.prompt_tokens_details.cached_tokens == len(trunk) - 1
        # session_id pins a trajectory: the request cuts it back to what it shares
        pinned = client.completions.create(
            model="reflect",
            prompt=PROMPT[:10] + [1],
            max_tokens=2,
            extra_body={"session_id": branch.session_id},
        )
        assert (
            pinned.session_id == branch.session_id and pinned.usage.prompt_tokens_details.cached_tokens == 10
        )
        assert check_all_sessions(server) == 3


def _trajectory(responses) -> list[int]:
    ids = list(PROMPT)
    for (_, appended, _), r in zip(TURNS, responses, strict=True):
        ids += appended + list(r.choices[0].token_ids)
    return ids


def test_idle_sessions_are_dropped_only_when_the_block_pool_needs_their_blocks(tiny):
    model, dirs, _ = tiny
    probe = tiny_engine(tiny, "prelrshared")
    engine = precache.Engine(
        probe.model, adapters=dirs, method="prelrshared", kv_cache_bytes=4 * probe.pool.block_bytes
    )
    with live(engine) as (server, client):
        responses = _conversation(client)  # 33 tokens by the last turn: 3 of the 4 blocks
        # one conversation fits the pool: its session stays and every turn reads its whole prefix
        assert [r.usage.prompt_tokens_details.cached_tokens for r in responses[1:]] == [33, 41]
        assert check_all_sessions(server) == 1
        metrics = httpx.get(server.url[:-3] + "/metrics").text
        usage = server.app.state.engine.cache_usage()
        assert f"precache_kv_cache_bytes {float(usage['allocated'])}" in metrics
        exported = {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'^precache_kv_pool_bytes\{state="(\w+)"\} (\S+)$', metrics, re.M)
        }
        assert exported == {state: float(n) for state, n in usage.items()}


def _load_conversation(client, k: int) -> list[int]:
    """Conversation ``k``: three adapters, three turns each, streamed or not; returns cached tokens."""
    rng = random.Random(k)
    ids = [k + 3] + [rng.randrange(3, 95) for _ in range(rng.randrange(6, 20))]
    cached = []
    for turn in range(3):
        for agent in ("plan", "action", "reflect"):
            n = rng.randrange(1, 5)
            body = {"ignore_eos": True, "return_token_ids": True}
            if (k + turn) % 2:
                r = client.completions.create(
                    model=agent, prompt=ids, max_tokens=n, temperature=0, extra_body=body
                )
                out, usage = list(r.choices[0].token_ids), r.usage
            else:
                stream = client.completions.create(
                    model=agent,
                    prompt=ids,
                    max_tokens=n,
                    temperature=0.8,
                    seed=k,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=body,
                )
                chunks = list(stream)
                usage = chunks[-1].usage
                out = [rng.randrange(3, 95) for _ in range(usage.completion_tokens)]  # a client's edit
            assert usage.completion_tokens == n
            cached.append(usage.prompt_tokens_details.cached_tokens)
            ids = ids + out + [rng.randrange(3, 95) for _ in range(rng.randrange(1, 4))]
    return cached


@pytest.mark.parametrize(
    ("method", "all_kept"), [("prelrshared", True), ("rebaseshared-db", True), ("rebaseownshared-db", False)]
)
def test_sixteen_concurrent_conversations_over_three_adapters(tiny, method, all_kept):
    """Under ReBaseOwnShared the default pool cannot keep all 16 (each conversation's own segments
    are about a second cache), so idle conversations are reclaimed while the others run: no request
    fails (a turn's prefix match takes cached blocks the step had counted as free)."""
    with live(tiny_engine(tiny, method), max_step_tokens=64) as (server, client):
        with ThreadPoolExecutor(16) as pool:
            results = list(
                pool.map(lambda k: _load_conversation(client, k), range(16))
            )  # raises on any error
        kept = check_all_sessions(server)
        assert kept == 16 if all_kept else 0 < kept <= 16  # one trajectory per conversation kept
        metrics = httpx.get(server.url[:-3] + "/metrics").text
    if all_kept:
        assert all(all(c > 0 for c in cached[1:]) for cached in results)  # every later turn reused the cache
    assert 'precache_requests_total{outcome="error"}' not in metrics
    batches = _histogram(metrics, "precache_batch_requests")
    assert batches["count"] > 0 and batches["sum"] / batches["count"] > 1.5  # requests shared forwards


def _histogram(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        for part in ("count", "sum"):
            if line.startswith(f"{name}_{part} "):
                out[part] = float(line.split()[1])
    return out


def test_a_full_block_pool_drops_idle_sessions_and_retries(tiny):
    model, dirs, _ = tiny
    probe = tiny_engine(tiny, "prelrshared")
    engine = precache.Engine(
        probe.model, adapters=dirs, method="prelrshared", kv_cache_bytes=7 * probe.pool.block_bytes
    )
    prompts = [[(5 * k + i) % 90 + 3 for i in range(30)] for k in range(4)]  # 30 + 4 tokens: 3 blocks each
    with live(engine) as (server, client):
        out = [
            client.completions.create(
                model="plan", prompt=p, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
            )
            for p in prompts
        ]
        sessions = check_all_sessions(server)
        metrics = httpx.get(server.url[:-3] + "/metrics").text
    assert [r.usage.completion_tokens for r in out] == [4] * 4  # every request answered
    assert sessions == 2  # two trajectories fit the pool: older idle ones were dropped for the rest
    assert 'precache_requests_total{outcome="error"}' not in metrics
    want = _offline_single(tiny, prompts[-1])
    assert out[-1].choices[0].text == want


def _offline_single(tiny, prompt: list[int]) -> str:
    engine = tiny_engine(tiny, "prelrshared")
    s = engine.session()
    s.append(prompt)
    return engine.decode(s.generate("plan", max_new_tokens=4, ignore_eos=True).token_ids)
