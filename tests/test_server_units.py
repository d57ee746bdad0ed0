"""Server pieces without HTTP: the token trie, the session pool's reuse / fork / wait / eviction
rules, the step-wise turn against Session.generate, request validation."""

from __future__ import annotations

import pytest
import torch

from precache.cache.plan import run_plans
from precache.config import SamplingParams
from precache.engine.turn import SteppedTurn, TurnPhase
from precache.server.errors import APIError
from precache.server.prefix import TokenTrie
from precache.server.protocol import CompletionRequest, sampling_params
from precache.server.sessions import SessionPool
from tests.tiny import make_engine


def test_trie_matches_longest_prefix_first_and_updates_paths():
    trie = TokenTrie()
    trie.set("a", [1, 2, 3, 4])
    trie.set("b", [1, 2, 9])
    trie.set("c", [7, 8])
    assert trie.match([1, 2, 3, 5]) == [("a", 3), ("b", 2)]
    assert trie.match([1, 2, 3, 4, 5]) == [("a", 4), ("b", 2)]
    assert trie.match([5]) == []
    trie.set("a", [1, 2, 3, 6, 6])  # cut back and grown: only the new path counts
    assert trie.match([1, 2, 3, 4]) == [("a", 3), ("b", 2)]
    assert trie.match([1, 2, 3, 6, 6, 6]) == [("a", 5), ("b", 2)]
    trie.remove("b")
    assert trie.match([1, 2, 9]) == [("a", 2)] and len(trie) == 2
    trie.remove("a")
    trie.remove("c")
    assert len(trie) == 0 and not trie._root.children  # every node pruned


def test_sampling_params_name_the_bad_field():
    ok = sampling_params(CompletionRequest(model="m", prompt="x", max_tokens=3, temperature=0, stop="\n"), 16)
    assert (ok.max_new_tokens, ok.temperature, ok.stop) == (3, 0.0, ("\n",))
    assert sampling_params(CompletionRequest(model="m", prompt="x"), 16).max_new_tokens == 16
    for field, value in [("max_tokens", -1), ("temperature", 2.5), ("top_p", 0.0), ("n", 0), ("min_p", 1.5)]:
        with pytest.raises(APIError) as err:
            sampling_params(CompletionRequest(model="m", prompt="x", **{field: value}), 16)
        assert err.value.status == 400 and err.value.param == field


def _turn(session, agent, n):
    return SteppedTurn(session, agent, SamplingParams(max_new_tokens=n, temperature=0.0))


def _drive(turn, chunk):
    """Run a stepped turn alone, prefilling ``chunk`` tokens per forward."""
    while turn.phase is not TurnPhase.DONE:
        plans = turn.plans(chunk)
        turn.advance(run_plans(turn.session.engine.model, plans)[0])
    return turn.out


@pytest.mark.parametrize("method", ["nonshared", "prelrshared", "rebaseshared-lp", "rebaseshared-db"])
def test_stepped_turn_with_chunked_prefill_equals_session_generate(tiny, method):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method, prefix_caching=False)  # both sessions compute every token
    prompt = torch.randint(0, 90, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    ref, mine = engine.session(), engine.session()
    for s in (ref, mine):
        s.append(prompt)
    for agent, extra in [("plan", [4, 5, 6]), ("action", [7, 8]), ("reflect", [9])]:
        want = ref.generate(agent=agent, max_new_tokens=4, temperature=0.0).token_ids
        assert _drive(_turn(mine, agent, 4), chunk=5) == want
        assert mine.token_ids == ref.token_ids and mine.authors == ref.authors
        mine.check()
        for s in (ref, mine):
            s.append(extra)
    for a, b in zip(ref.state.stores(), mine.state.stores(), strict=True):
        assert a.length == b.length


def test_pool_reuses_continuations_forks_branches_and_waits_on_busy(tiny):
    model, dirs, _ = tiny
    pool = SessionPool(make_engine(model, dirs, "prelrshared"), min_fork_tokens=8)
    first = pool.acquire(list(range(10, 30)))
    assert first.how == "new" and first.common == 0
    assert pool.acquire(list(range(10, 40))) is None  # continues a busy conversation: wait
    other = pool.acquire(list(range(50, 60)))
    assert other.how == "new" and other.entry is not first.entry  # unrelated: nothing shared
    pool.release(other.entry)
    first.entry.session.append([1, 2])  # as if the turn had answered
    pool.release(first.entry)
    again = pool.acquire(list(range(10, 30)) + [1, 2, 3])
    assert again.how == "reuse" and again.entry is first.entry and again.common == 22
    pool.release(again.entry)
    branch = pool.acquire(list(range(10, 25)) + [5, 5])  # shares 15 of 23: a branch
    assert branch.how == "fork" and branch.common == 15 and branch.entry is not first.entry
    assert first.entry.session.token_ids[:23] == list(range(10, 30)) + [1, 2, 3]  # untouched
    pinned = pool.acquire([3, 3, 3], session_id=first.entry.sid)
    assert pinned.how == "pinned" and pinned.entry.session.token_ids == [3, 3, 3]


def test_pool_evicts_idle_sessions_least_recently_used_first(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    pool = SessionPool(engine, max_bytes=None)
    claims = []
    for i in range(3):
        claim = pool.acquire([20 + i] * 6)
        _drive(_turn(claim.entry.session, "plan", 2), chunk=64)
        pool.release(claim.entry)
        claims.append(claim)
    per_session = claims[0].entry.session.cache_bytes()["total"]
    busy = pool.acquire([20] * 6 + [1])  # the oldest one is busy again: never evicted
    pool.max_bytes = per_session * 2
    assert pool.evict() == 1
    assert set(pool.entries) == {claims[0].entry.key, claims[2].entry.key} and busy.entry is claims[0].entry
    assert pool.total_bytes() <= pool.max_bytes
