"""The engine scheduler: one forward per step over every session's rows, offline concurrency equal
to sequential runs, chunked prefill, one request per session at a time, typed errors, forks."""

from __future__ import annotations

import pytest
import torch

from precache.engine import Phase, RequestState, run_concurrently
from precache.errors import (
    ContextLengthError,
    RequestCancelledError,
    SessionBusyError,
    UnknownAdapterError,
)
from precache.methods import METHODS
from tests.tiny import make_engine

# (agent, tokens appended before the turn, max new tokens): a short multi-agent trajectory
SCRIPT = [("plan", 14, 4), ("action", 5, 3), ("reflect", 6, 3), ("plan", 3, 2)]


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_trajectory(engine, seed: int) -> list[list[int]]:
    """SCRIPT on a new session with appended ids drawn from ``seed``; the generated ids per turn."""
    s = engine.session()
    out = []
    for i, (agent, n_append, n_new) in enumerate(SCRIPT):
        s.append(_ids(seed * 100 + i, n_append))
        out.append(s.generate(agent, max_new_tokens=n_new, temperature=0.0).token_ids)
    s.check()
    return out


@pytest.mark.parametrize("method", METHODS)
def test_concurrent_trajectories_give_the_sequential_greedy_tokens(tiny, method):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method)
    seeds = [1, 2, 3, 4]
    steps = engine.scheduler.steps
    sequential = [run_trajectory(engine, seed) for seed in seeds]
    steps_sequential = engine.scheduler.steps - steps
    # the concurrent half on an engine of its own: the selective baselines take back the views the
    # sequential runs published (issue 36), and CacheBlend's recompute then picks among fewer tokens
    engine = make_engine(model, dirs, method)
    steps = engine.scheduler.steps
    concurrent = engine.run_concurrently(lambda seed: run_trajectory(engine, seed), seeds, concurrency=4)
    assert concurrent == sequential  # results in input order, tokens as run alone
    assert engine.scheduler.steps - steps < steps_sequential  # forwards were shared
    assert not engine.scheduler.has_work


@pytest.mark.parametrize(
    ("method", "rows"), [("prelrshared", 1), ("rebaseshared-db", 2), ("rebaseownshared-db", 2)]
)
def test_one_step_batches_the_rows_of_every_session(tiny, method, rows):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method)
    prompts = [_ids(seed, 12 + seed) for seed in range(3)]
    alone = []
    for prompt in prompts:
        s = engine.session()
        s.append(prompt)
        alone.append(s.generate("action", max_new_tokens=5).token_ids)
    sessions = [engine.session() for _ in prompts]
    requests = []
    for s, prompt in zip(sessions, prompts, strict=True):
        s.append(prompt)
        requests.append(s.submit("action", max_new_tokens=5))
    batches = []
    while not all(r.finished for r in requests):
        batches.append(engine.step())
    assert len(batches) == 5  # one prefill forward and four decode forwards, for all three turns
    assert [len(b.requests) for b in batches] == [3] * 5
    assert [b.rows for b in batches] == [3 * rows] * 5  # DB's neutral row rides along
    assert batches[0].tokens == rows * sum(len(p) for p in prompts) and batches[1].tokens == 3 * rows
    assert [r.outcome().token_ids for r in requests] == alone
    assert [r.state for r in requests] == [RequestState.FINISHED] * 3


def test_chunked_prefill_within_the_step_budget_gives_the_same_tokens(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "rebaseshared-lp", prefix_caching=False)  # every prompt is prefilled
    prompts = [_ids(seed, 20) for seed in range(3)]
    whole = engine.generate_batch(prompts, agent="plan", max_new_tokens=4)
    engine.configure(max_running=2, max_step_tokens=8)
    sessions = [engine.session() for _ in prompts]
    requests = []
    for s, prompt in zip(sessions, prompts, strict=True):
        s.append(prompt)
        requests.append(s.submit("plan", max_new_tokens=4))
    chunks = []  # prefill tokens per forward; decode rows and LP's post-turn passes come on top
    while not all(r.finished for r in requests):
        prefilling = {r for r in requests if r.phase in (None, Phase.PREFILL)}
        batch = engine.step()
        assert len(batch.requests) <= 2  # max_running
        chunks.append(
            sum(
                len(p[0].token_ids)
                for r, p in zip(batch.requests, batch.plans, strict=True)
                if r in prefilling
            )
        )
    assert max(chunks) == 8 and sum(chunks) == 60 and len([c for c in chunks if c]) == 8
    assert [r.outcome().token_ids for r in requests] == [t.token_ids for t in whole]
    for s in sessions:
        s.check()


def test_turns_on_one_session_run_one_after_the_other(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    a, b = engine.session(), engine.session()
    for s in (a, b):
        s.append(_ids(7, 16))
    first, second = a.submit("plan", max_new_tokens=3), a.submit("action", max_new_tokens=2)
    turns = engine.wait_all([first, second])
    want = [b.generate("plan", max_new_tokens=3), b.generate("action", max_new_tokens=2)]
    assert [t.token_ids for t in turns] == [t.token_ids for t in want]
    assert turns[1].prompt_tokens == 16 + 3 and a.token_ids == b.token_ids and a.authors == b.authors


def test_typed_errors_surface_from_bad_requests(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    s = engine.session()
    s.append([3] * 250)
    with pytest.raises(UnknownAdapterError, match="adapter 'critic' is not loaded"):
        s.submit("critic")
    # valid when queued, but the turn before it fills the context: refused when its turn opens
    fills, late = s.submit("plan", max_new_tokens=20), s.submit("action", max_new_tokens=2)
    engine.wait(late)
    assert len(fills.outcome().token_ids) == 6 and late.state is RequestState.FAILED
    with pytest.raises(ContextLengthError, match="256 tokens"):
        late.outcome()
    # cancelled while waiting
    t = engine.session()
    t.append([4] * 10)
    request = t.submit("plan", max_new_tokens=3)
    engine.cancel(request)
    engine.wait(request)
    with pytest.raises(RequestCancelledError):
        request.outcome()
    assert len(t) == 10
    # a session cannot change under a running turn
    stream = t.stream("plan", max_new_tokens=5)
    next(stream)
    with pytest.raises(SessionBusyError):
        t.append([1])
    with pytest.raises(SessionBusyError):
        t.fork(5)
    stream.close()
    t.check()
    assert len(t.generate("action", max_new_tokens=2).token_ids) == 2


def test_a_failed_forward_fails_its_requests_and_the_engine_goes_on(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "fullshared")
    forward = engine.scheduler.forward

    def broken(plans):
        raise RuntimeError("device lost")

    engine.scheduler.forward = broken
    s = engine.session()
    s.append(_ids(1, 8))
    with pytest.raises(RuntimeError, match="device lost"):
        s.generate("plan", max_new_tokens=2)
    assert s.active is None and s.state.turn_start is None
    engine.scheduler.forward = forward
    fresh = engine.session()
    fresh.append(_ids(1, 8))
    assert len(fresh.generate("plan", max_new_tokens=2).token_ids) == 2


@pytest.mark.parametrize("method", METHODS)
def test_a_fork_goes_on_like_a_session_with_the_same_history(tiny, method):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method)

    def history():
        s = engine.session()
        s.append(_ids(1, 16))
        s.generate("plan", max_new_tokens=3)
        s.append(_ids(2, 5))
        s.generate("action", max_new_tokens=3)
        return s

    parent = history()
    n = len(parent)
    whole, cut = parent.fork(n), parent.fork(10)
    assert whole.token_ids == parent.token_ids and whole.authors == parent.authors and len(cut) == 10
    parent.append(_ids(3, 4))  # the parent goes on: its forks do not see it
    parent_turn = parent.generate("reflect", max_new_tokens=3)
    extra = _ids(4, 6)
    for fork, keep in ((whole, n), (cut, 10)):
        fresh = history()
        fresh.sync(fresh.token_ids[:keep] + extra)
        fork.append(extra)
        got, want = fork.generate("reflect", max_new_tokens=3), fresh.generate("reflect", max_new_tokens=3)
        assert got.token_ids == want.token_ids and fork.token_ids == fresh.token_ids
        assert (got.first_logits - want.first_logits).abs().max() <= 1e-5
        fork.check()
    again = history()
    again.append(_ids(3, 4))
    assert again.generate("reflect", max_new_tokens=3).token_ids == parent_turn.token_ids


def test_generate_batch_equals_one_session_per_prompt(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    prompts = [_ids(seed, 6 + 3 * seed) for seed in range(4)]
    turns = engine.generate_batch(prompts, agent="reflect", max_new_tokens=4)
    for prompt, turn in zip(prompts, turns, strict=True):
        s = engine.session()
        s.append(prompt)
        assert turn.token_ids == s.generate("reflect", max_new_tokens=4).token_ids
        assert turn.prompt_tokens == len(prompt) and turn.appended == tuple(prompt)
    with pytest.raises(UnknownAdapterError):
        engine.generate_batch(prompts, agent="critic")
    assert not engine.scheduler.has_work  # nothing was queued


def test_run_concurrently_keeps_the_order_and_raises_the_first_error():
    assert run_concurrently(lambda x: x * x, range(7), concurrency=3) == [x * x for x in range(7)]

    def fail_on_three(x):
        if x == 3:
            raise ValueError("three")
        return x

    with pytest.raises(ValueError, match="three"):
        run_concurrently(fail_on_three, range(6), concurrency=2)
    with pytest.raises(ValueError, match="at least 1"):
        run_concurrently(abs, [1], concurrency=0)


def test_fidelity_with_concurrency_equals_the_sequential_run(tiny, monkeypatch):
    from precache.bench import episodes
    from tests.test_bench_fidelity import _fake_episode, _Question

    model, dirs, _ = tiny
    monkeypatch.setattr(episodes, "run_episode", _fake_episode)
    engines = {m: make_engine(model, dirs, m) for m in ("nonshared", "prelrshared", "rebaseshared-db")}
    questions = [_Question(f"q{i}", str(i)) for i in range(4)]
    one = episodes.run_fidelity(engines, questions, max_new_tokens=3)
    four = episodes.run_fidelity(engines, questions, concurrency=4, max_new_tokens=3)
    for name in engines:
        assert four["methods"][name]["answers"] == one["methods"][name]["answers"]
        assert [r["question"] for r in four["per_turn"][name]] == [
            r["question"] for r in one["per_turn"][name]
        ]
        for a, b in zip(four["per_turn"][name], one["per_turn"][name], strict=True):
            assert a["first_kl"] == pytest.approx(b["first_kl"], abs=1e-6) and a["top1"] == b["top1"]
