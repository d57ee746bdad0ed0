"""The engine owns the request: preemption under a small block pool always makes progress and keeps
every token (swap out, resume on caches equal bit for bit), streams resume where they stopped,
``n`` choices decode in the same steps and equal the choices run one by one, and random
arrivals, cancellations and pool sizes never lose or duplicate a token and end with every block
free."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precache.engine import RequestState
from precache.engine.request import Phase
from precache.errors import CacheCapacityError, RequestCancelledError
from precache.methods import METHODS
from tests.tiny import make_engine


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _block_bytes(tiny, method: str) -> int:
    model, dirs, _ = tiny
    return make_engine(model, dirs, method, kv_cache_bytes=1 << 24).pool.block_bytes


def _alone(tiny, method: str, prompt: list[int], agent: str, **params) -> list[int]:
    model, dirs, _ = tiny
    s = make_engine(model, dirs, method, prefix_caching=False).session()
    s.append(prompt)
    return s.generate(agent, **params).token_ids


AGENTS = ("plan", "action", "reflect")


@pytest.mark.parametrize("method", METHODS)
def test_a_small_pool_preempts_and_every_request_gets_its_alone_tokens(tiny, method):
    model, dirs, _ = tiny
    engine = make_engine(
        model, dirs, method, prefix_caching=False, kv_cache_bytes=14 * _block_bytes(tiny, method)
    )
    prompts = [_ids(seed, 30 + 7 * seed) for seed in range(5)]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    sessions = [engine.session() for _ in prompts]
    requests = []
    for i, (s, p) in enumerate(zip(sessions, prompts, strict=True)):
        s.append(p)
        requests.append(s.submit(AGENTS[i % 3], **params))
    engine.wait_all(requests)
    assert engine.scheduler.preemptions > 0  # the pool could not hold them all at once
    for i, (r, p) in enumerate(zip(requests, prompts, strict=True)):
        assert r.outcome().token_ids == _alone(tiny, method, p, AGENTS[i % 3], **params)
        assert [c.token_id for c in r.chunks] == r.outcome().token_ids  # every token once
        r.session.check()
    for s in sessions:
        s.close()
    assert engine.pool.allocator.num_held == 0
    engine.pool.allocator.check()


def test_a_younger_request_never_preempts_an_older_one(tiny):
    model, dirs, _ = tiny
    engine = make_engine(
        model, dirs, "prelrshared", prefix_caching=False, kv_cache_bytes=9 * _block_bytes(tiny, "prelrshared")
    )
    old, young = engine.session(), engine.session()
    old.append(_ids(1, 40))
    young.append(_ids(2, 40))
    params = {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True}
    r_old = old.submit("plan", **params)
    r_young = young.submit("action", **params)
    while not r_old.finished:
        engine.step()
        assert r_old.preemptions == 0 and r_old.state is not RequestState.PREEMPTED
    engine.wait(r_young)
    assert r_young.preemptions > 0
    assert r_young.outcome().token_ids == _alone(tiny, "prelrshared", _ids(2, 40), "action", **params)


@pytest.mark.parametrize(
    ("method", "blocks"), [("prelrshared", 10), ("rebaseshared-lp", 16), ("droidspeak", 18)]
)
def test_a_stream_preempted_mid_way_resumes_with_the_text_of_an_unpreempted_run(tiny, method, blocks):
    model, dirs, _ = tiny
    engine = make_engine(
        model, dirs, method, prefix_caching=False, kv_cache_bytes=blocks * _block_bytes(tiny, method)
    )
    params = {"max_new_tokens": 50, "temperature": 0.0, "ignore_eos": True}
    older, streamed = engine.session(), engine.session()
    older.append(_ids(3, 60))
    streamed.append(_ids(4, 40))
    r_older = older.submit("plan", **params)
    chunks, preempted_at = [], []
    for chunk in streamed.stream("reflect", **params):
        chunks.append(chunk)
        preempted_at.append(streamed.active.preemptions if streamed.active is not None else None)
    request = streamed.last_turn
    assert (
        preempted_at[0] == 0 and max(p for p in preempted_at if p is not None) > 0
    )  # after its first tokens
    assert r_older.outcome().token_ids  # the older one ran through, never preempted
    assert r_older.preemptions == 0
    unpreempted = make_engine(model, dirs, method, prefix_caching=False).session()
    unpreempted.append(_ids(4, 40))
    want = unpreempted.generate("reflect", **params)
    assert [c.token_id for c in chunks] == want.token_ids
    assert "".join(c.text for c in chunks) == want.text == request.text
    assert engine.scheduler.preemptions > 0


@pytest.mark.parametrize(
    "method",
    ["nonshared", "prelrshared", "rebaseshared-lp", "rebaseshared-db", "rebaseownshared-db", "cacheblend"],
)
def test_n_choices_decode_in_the_same_steps_and_equal_the_forks_run_one_by_one(tiny, method):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method, prefix_caching=False)
    prompt = _ids(5, 35)
    params = {"max_new_tokens": 12, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    s = engine.session()
    s.append(_ids(6, 20))
    s.generate("plan", max_new_tokens=4)  # an earlier turn: the choices continue a trajectory
    s.append(prompt)
    history = list(s.token_ids)
    request = s.submit("action", n=4, **params)
    rows_per_step = []
    while not request.all_finished:
        batch = engine.step()
        rows_per_step.append(sorted(r.index for r in batch.requests))
    decoding = [rows for rows in rows_per_step[1:] if rows]
    assert decoding[: params["max_new_tokens"] - 1] == [[0, 1, 2, 3]] * (params["max_new_tokens"] - 1)
    turns = request.outcomes()
    assert [t.index for t in turns] == [0, 1, 2, 3]
    assert turns[0].prefill_tokens > 0 and all(t.prefill_tokens == 0 for t in turns[1:])  # prefilled once
    for i, turn in enumerate(turns):
        one = make_engine(model, dirs, method, prefix_caching=False).session()
        one.append(_ids(6, 20))
        one.generate("plan", max_new_tokens=4)
        one.append(prompt)
        assert one.token_ids == history
        want = one.generate("action", **{**params, "seed": 7 + i})
        assert turn.token_ids == want.token_ids and turn.text == want.text
    assert s.token_ids == history + turns[0].token_ids  # the trajectory goes on with choice 0
    for child in request.children:
        child.session.close()
    s.close()
    assert engine.pool.allocator.num_held == 0


def test_generate_refuses_n_and_generate_choices_returns_them(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    s = engine.session()
    s.append(_ids(8, 12))
    with pytest.raises(ValueError, match="generate_choices"):
        s.generate("plan", n=2)
    turns = s.generate_choices("plan", n=3, max_new_tokens=3, temperature=1.0, seed=1)
    assert len(turns) == 3 and [t.index for t in turns] == [0, 1, 2]
    assert engine.cache_usage()["allocated"] == s.cache_bytes()["total"]  # the forks were closed


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    pool_blocks=st.integers(min_value=9, max_value=24),
    method=st.sampled_from(
        ["prelrshared", "nonshared", "rebaseshared-lp", "rebaseownshared-lp", "fullshared"]
    ),
)
def test_random_arrivals_cancellations_and_pool_sizes_keep_every_token(tiny, data, pool_blocks, method):
    model, dirs, _ = tiny
    engine = make_engine(
        model, dirs, method, prefix_caching=False, kv_cache_bytes=pool_blocks * _block_bytes(tiny, method)
    )
    n_requests = data.draw(st.integers(2, 6), label="requests")
    specs = [
        (
            data.draw(st.integers(0, 30), label="arrival step"),
            data.draw(st.integers(5, 60), label="prompt"),
            data.draw(st.integers(1, 30), label="new tokens"),
            data.draw(st.one_of(st.none(), st.integers(1, 40)), label="cancel after steps"),
        )
        for _ in range(n_requests)
    ]
    pending = sorted(enumerate(specs), key=lambda item: item[1][0])
    live: dict[int, tuple] = {}
    step = 0
    while pending or any(not r.finished for r, *_ in live.values()):
        while pending and pending[0][1][0] <= step:
            i, (_, n_prompt, n_new, cancel) = pending.pop(0)
            s = engine.session()
            s.append(_ids(100 + i, n_prompt))
            params = {"max_new_tokens": n_new, "temperature": 0.0, "ignore_eos": True}
            live[i] = (s.submit(AGENTS[i % 3], **params), s, params, step + cancel if cancel else None)
        for r, _, _, cancel_at in live.values():
            if cancel_at is not None and step >= cancel_at and not r.finished:
                engine.cancel(r)
        engine.step()
        step += 1
        assert step < 2000, "the scheduler made no progress"
    for i, (r, s, params, _) in live.items():
        n_prompt = specs[i][1]
        want = _alone(tiny, method, _ids(100 + i, n_prompt), AGENTS[i % 3], **params)
        streamed = [c.token_id for c in r.chunks]
        if r.state is RequestState.FAILED:  # could never fit the pool alone: refused before it ran
            assert isinstance(r.error, CacheCapacityError) and not streamed
            assert s.token_ids == _ids(100 + i, n_prompt)
            s.close()
            continue
        if r.state is RequestState.CANCELLED:
            with pytest.raises(RequestCancelledError):
                r.outcome()
            got = r.result.token_ids if r.result is not None else []
            assert got == want[: len(got)]  # a prefix of the run alone, nothing lost or repeated
        else:
            got = r.outcome().token_ids
            assert got == want
        assert streamed == got
        assert s.token_ids == _ids(100 + i, n_prompt) + got
        s.check()
        s.close()
    assert engine.pool.allocator.num_held == 0
    engine.pool.allocator.check()


def test_a_request_cancelled_before_its_prefill_ran_retires_without_rows(tiny):
    """Found by the property test above: a request admitted (turn open) whose prefill did not fit
    the step, cancelled before it ran, closes its turn with nothing prefilled; it must retire that
    step, not run prefill rows on the closed turn (ReBaseShared had no turn cache left for them)."""
    model, dirs, _ = tiny
    method = "rebaseshared-lp"  # its turn cache is gone once the turn closes
    engine = make_engine(
        model, dirs, method, prefix_caching=False, kv_cache_bytes=9 * _block_bytes(tiny, method)
    )
    small = [engine.session() for _ in range(2)]
    for i, s in enumerate(small):
        s.append(_ids(100 + i, 5))
    big = engine.session()
    big.append(_ids(103, 33))
    params = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    requests = [s.submit(AGENTS[i], **params) for i, s in enumerate(small)]
    cancelled = big.submit("plan", **params)
    engine.step()  # the small ones run; the big one's turn is open but its rows did not fit
    assert cancelled.phase is Phase.PREFILL and cancelled.prefill_tokens == 0
    engine.cancel(cancelled)
    ran = engine.step()
    assert cancelled not in ran.requests and cancelled.finished
    assert cancelled.state is RequestState.CANCELLED and not cancelled.chunks
    assert big.token_ids == _ids(103, 33)
    for i, r in enumerate(requests):
        assert r.outcome().token_ids == _alone(tiny, method, _ids(100 + i, 5), AGENTS[i], **params)
    big.check()
