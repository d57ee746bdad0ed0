"""Server pieces without HTTP: the token trie, the session pool's reuse / fork / wait / eviction
rules, the step-wise turn against Session.generate, request validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precache.cache.plan import run_plans
from precache.cache.prefix import TrajectoryIndex, common_prefix
from precache.config import SamplingParams
from precache.engine.request import Phase, Request
from precache.server.errors import APIError
from precache.server.protocol import CompletionRequest, sampling_params
from precache.server.sessions import SessionPool
from tests.tiny import make_engine


def test_trajectory_index_matches_longest_prefix_first_and_updates_paths():
    index = TrajectoryIndex(block_size=2)
    index.set("a", [1, 2, 3, 4])
    index.set("b", [1, 2, 9])
    index.set("c", [7, 8])
    index.set("d", [1, 2, 3, 4], salt="other tenant")  # another tenant's chain: never matched
    assert index.match([1, 2, 3, 5]) == [("a", 3), ("b", 2)]
    assert index.match([1, 2, 3, 4, 5]) == [("a", 4), ("b", 2)]
    assert index.match([5]) == [] and index.match([1, 2, 3, 4], salt="other tenant") == [("d", 4)]
    index.set("a", [1, 2, 3, 6, 6])  # cut back and grown: only the new path counts
    assert index.match([1, 2, 3, 4]) == [("a", 3), ("b", 2)]
    assert index.match([1, 2, 3, 6, 6, 6]) == [("a", 5), ("b", 2)]
    index.remove("b")
    assert index.match([1, 2, 9]) == [("a", 2)] and len(index) == 3
    for key in ("a", "c", "d"):
        index.remove(key)
    assert len(index) == 0 and not index._by_hash and not index._by_first  # nothing left behind


@settings(max_examples=60, deadline=None)
@given(
    paths=st.dictionaries(
        st.integers(0, 5), st.tuples(st.lists(st.integers(0, 3), max_size=12), st.sampled_from([None, "t"]))
    ),
    prompt=st.lists(st.integers(0, 3), max_size=12),
    salt=st.sampled_from([None, "t"]),
    block_size=st.integers(1, 4),
)
def test_trajectory_index_equals_a_brute_force_scan(paths, prompt, salt, block_size):
    index = TrajectoryIndex(block_size)
    for key, (path, tenant) in paths.items():
        index.set(key, path, tenant)
    want = {
        key: common_prefix(path, prompt)
        for key, (path, tenant) in paths.items()
        if tenant == salt and common_prefix(path, prompt) > 0
    }
    got = index.match(prompt, salt)
    assert dict(got) == want and len(got) == len(want)
    assert [n for _, n in got] == sorted(want.values(), reverse=True)


def test_sampling_params_name_the_bad_field():
    ok = sampling_params(CompletionRequest(model="m", prompt="x", max_tokens=3, temperature=0, stop="\n"), 16)
    assert (ok.max_new_tokens, ok.temperature, ok.stop) == (3, 0.0, ("\n",))
    assert sampling_params(CompletionRequest(model="m", prompt="x"), 16).max_new_tokens == 16
    for field, value in [("max_tokens", -1), ("temperature", 2.5), ("top_p", 0.0), ("n", 0), ("min_p", 1.5)]:
        with pytest.raises(APIError) as err:
            sampling_params(CompletionRequest(model="m", prompt="x", **{field: value}), 16)
        assert err.value.status == 400 and err.value.param == field


def _turn(session, agent, n):
    request = Request(session, agent, SamplingParams(max_new_tokens=n, temperature=0.0))
    request.open()
    return request


def _drive(turn, chunk):
    """Run a request alone, prefilling ``chunk`` tokens per forward."""
    while turn.phase is not Phase.DONE:
        plans = turn.plans(chunk)
        logits = run_plans(turn.session.engine.model, plans)[0]
        if turn.ran():
            turn.sample(logits)
    turn.complete()
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
    assert other.how == "new" and other is not first  # unrelated: nothing shared
    pool.release(other)
    first.session.append([1, 2])  # as if the turn had answered
    pool.release(first)
    again = pool.acquire(list(range(10, 30)) + [1, 2, 3])
    assert again.how == "reuse" and again is first and again.common == 22
    pool.release(again)
    branch = pool.acquire(list(range(10, 25)) + [5, 5])  # shares 15 of 23: a branch
    assert branch.how == "fork" and branch.common == 15 and branch is not first
    assert first.session.token_ids[:23] == list(range(10, 30)) + [1, 2, 3]  # untouched
    pinned = pool.acquire([3, 3, 3], session_id=first.sid)
    assert pinned.how == "pinned" and pinned.session.token_ids == [3, 3, 3]


def test_pool_reclaims_idle_sessions_least_recently_used_first(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared", prefix_caching=False)
    pool = SessionPool(engine)
    entries = []
    for i in range(3):
        entry = pool.acquire([20 + i] * 6)
        _drive(_turn(entry.session, "plan", 2), chunk=64)
        pool.release(entry)
        entries.append(entry)
    per_session = len(entries[0].session.state.base.blocks)
    busy = pool.acquire([20] * 6 + [1])  # the oldest one is busy again: never dropped
    free = engine.pool.allocator.num_available
    assert pool.reclaim(per_session) == per_session  # one idle session is enough: the LRU one
    assert set(pool.entries) == {entries[0].key, entries[2].key} and busy is entries[0]
    assert engine.pool.allocator.num_available == free + per_session
    assert pool.reclaim(10**6) == per_session and set(pool.entries) == {entries[0].key}
