"""The request as one declared record (issue 37): ``Request`` has slots and no ``__dict__``, its
state is an Enum that moves WAITING -> RUNNING (-> PREEMPTED -> RUNNING) -> FINISHED, CANCELLED
or FAILED as the engine runs it, ``Request.choice`` builds a choice whose fields equal its
parent's where the prompt was prefilled once and differ where a choice is its own, and the
engine's typed errors carry the ``param`` the server reports and survive pickling."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from precache.engine import Phase, Request, RequestState
from precache.errors import (
    CacheCapacityError,
    ContextLengthError,
    EmptyRequestError,
    InvalidParameterError,
    PrecacheError,
    UnknownAdapterError,
)
from tests.tiny import make_engine

#: the tiny model's context length (tests/tiny.py)
MAX_CONTEXT = 256


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _steps(engine, request: Request) -> list[tuple[RequestState, Phase | None, int]]:
    """``(state, phase, tokens out)`` of ``request`` as queued, then after every step until it ends."""
    seen = [(request.state, request.phase, len(request.out))]
    while not request.finished:
        engine.step()
        seen.append((request.state, request.phase, len(request.out)))
    return seen


def test_a_request_declares_every_field_and_takes_no_other(tiny):
    model, dirs, _ = tiny
    s = make_engine(model, dirs, "prelrshared").session()
    s.append(_ids(1, 8))
    request = s.submit("plan", max_new_tokens=2)
    assert not hasattr(request, "__dict__")
    assert set(Request.__slots__) == {f.name for f in dataclasses.fields(Request)}
    with pytest.raises(AttributeError):
        request.retries = 1  # not a field: no attribute can be made up after construction
    request.held = True  # a declared field is writable
    assert request.held is True
    request.held = False
    assert (request.state, request.phase, request.index, request.parent) == (
        RequestState.WAITING,
        None,
        0,
        None,
    )
    s.engine.wait(request)
    assert request.outcome().token_ids == request.out and len(request.out) == 2


@pytest.mark.parametrize(
    ("method", "post"),
    [("prelrshared", []), ("rebaseshared-lp", [(RequestState.RUNNING, Phase.POST, 3)])],
)
def test_state_and_phase_move_as_the_engine_runs_the_turn(tiny, method, post):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method, max_step_tokens=5)
    s = engine.session()
    s.append(_ids(2, 12))
    request = s.submit("plan", max_new_tokens=3, temperature=0.0)
    running = RequestState.RUNNING
    # 12 prompt tokens in chunks of 5: two inner chunks, the last one samples the first token;
    # ReBaseShared-LP's neutral pass runs one step after the last token
    assert _steps(engine, request) == [
        (RequestState.WAITING, None, 0),
        (running, Phase.PREFILL, 0),
        (running, Phase.PREFILL, 0),
        (running, Phase.DECODE, 1),
        (running, Phase.DECODE, 2),
        *post,
        (RequestState.FINISHED, Phase.DONE, 3),
    ]
    assert s.active is None and s.last_turn is request.result and request.result.prompt_tokens == 12
    assert request.prefill_tokens == 12


def test_a_younger_request_goes_through_preempted_and_back(tiny):
    model, dirs, _ = tiny
    block = make_engine(model, dirs, "prelrshared", kv_cache_bytes=1 << 24).pool.block_bytes
    engine = make_engine(model, dirs, "prelrshared", prefix_caching=False, kv_cache_bytes=9 * block)
    old, young = engine.session(), engine.session()
    old.append(_ids(1, 40))
    young.append(_ids(2, 40))
    params = {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True}
    r_old, r_young = old.submit("plan", **params), young.submit("action", **params)
    states = [r_young.state]
    while not r_young.finished:
        engine.step()
        if r_young.state is not states[-1]:
            states.append(r_young.state)
    assert r_old.state is RequestState.FINISHED and r_young.preemptions == 1
    assert states == [
        RequestState.WAITING,
        RequestState.RUNNING,
        RequestState.PREEMPTED,
        RequestState.RUNNING,
        RequestState.FINISHED,
    ]
    assert len(r_young.outcome().token_ids) == 60


def test_cancelled_and_failed_requests_end_in_their_states(tiny):
    model, dirs, _ = tiny
    block = make_engine(model, dirs, "prelrshared", kv_cache_bytes=1 << 24).pool.block_bytes
    engine = make_engine(model, dirs, "prelrshared", kv_cache_bytes=4 * block)
    s = engine.session()
    s.append(_ids(3, 8))
    waiting = s.submit("plan", max_new_tokens=2)
    engine.cancel(waiting)
    engine.wait(waiting)
    assert (waiting.state, waiting.phase, waiting.out) == (RequestState.CANCELLED, None, [])
    # valid when submitted; refused as its turn opens: 8 + 200 tokens never fit 4 blocks
    too_big = s.submit("plan", max_new_tokens=200)
    engine.wait(too_big)
    assert too_big.state is RequestState.FAILED and isinstance(too_big.error, CacheCapacityError)
    assert s.active is None and len(s.token_ids) == 8  # the session is free and unchanged
    with pytest.raises(CacheCapacityError):
        too_big.outcome()


def test_choice_shares_the_prefilled_prompt_and_owns_its_session_index_and_seed(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    s = engine.session()
    s.append(_ids(4, 10))
    parent = s.submit("action", n=3, seed=11, temperature=0.8, top_k=20, max_new_tokens=4, stop=["zz"])
    engine.step()  # the prompt's only chunk: choices 1 and 2 fork and sample their first tokens
    assert [c.index for c in parent.children] == [1, 2]
    for child in parent.children:
        i = child.index
        # what a choice shares with its parent: the prompt was prefilled once, by choice 0
        assert child.parent is parent and child.agent == "action" and child.arrival == parent.arrival
        assert child.params == dataclasses.replace(parent.params, n=1, seed=11 + i)
        assert (child.params.temperature, child.params.top_k, child.params.stop) == (0.8, 20, ("zz",))
        for name in ("budget", "prompt_tokens", "appended", "cached_tokens", "reread", "pos", "t_open"):
            assert getattr(child, name) == getattr(parent, name), name
        assert child.session.token_ids[:10] == parent.session.token_ids[:10]
        assert child.session.authors[:10] == parent.session.authors[:10]
        # what is its own: its session (a fork, turn open), id, decoder, no prefill booked
        assert child.session is not parent.session and child.session.active is child
        assert child.id != parent.id and child.priority > parent.priority
        assert child.decoder is not parent.decoder and child.decoder.index == i
        assert (child.state, child.phase, len(child.out), child.prefill_tokens) == (
            RequestState.RUNNING,
            Phase.DECODE,
            1,
            0,
        )
        assert child.children == [] and [c.token_id for c in child.chunks] == child.out
    assert parent.params.seed == 11 and parent.params.n == 3 and parent.prefill_tokens == 10
    engine.wait(parent)
    turns = parent.outcomes()
    assert [t.index for t in turns] == [0, 1, 2] and all(len(t.token_ids) == 4 for t in turns)
    for child in parent.children:
        child.session.close()

    unseeded = s.submit("plan", n=2, max_new_tokens=2)
    engine.wait(unseeded)
    (child,) = unseeded.children
    assert child.params.seed is None and child.params == dataclasses.replace(unseeded.params, n=1)
    child.session.close()


def test_typed_errors_carry_the_param_the_server_reports(tiny):
    from precache.server.errors import engine_refusal

    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    s = engine.session()
    with pytest.raises(EmptyRequestError) as empty:
        s.submit("plan")
    s.append([3] * MAX_CONTEXT)  # fills the context: no room for a new token
    with pytest.raises(ContextLengthError, match=f"{MAX_CONTEXT} tokens") as full:
        s.submit("plan", max_new_tokens=1)
    with pytest.raises(ContextLengthError) as full_generate:
        s.generate("plan")
    s.close()
    s.append(_ids(5, 250))
    with pytest.raises(ContextLengthError) as forced:
        s.teacher_force("plan", [5] * 7)  # 250 + 7 > 256
    with pytest.raises(InvalidParameterError) as stop_ids:
        s.submit("plan", stop_token_ids=[model.config.vocab_size])
    with pytest.raises(
        UnknownAdapterError, match=r"adapter 'critic' is not loaded \(loaded: plan"
    ) as unknown:
        s.submit("critic")
    errors = [empty, full, full_generate, forced, stop_ids, unknown]
    params = [e.value.param for e in errors]
    assert params == ["prompt", "prompt", "prompt", "token_ids", "stop_token_ids", None]
    # the server's 400 for each body error: the same param, a code by type
    refusals = [engine_refusal(e.value) for e in errors[:5]]
    assert [(r.status, r.param) for r in refusals] == [(400, p) for p in params[:5]]
    assert [r.code for r in refusals] == [
        "empty_prompt",
        "context_length_exceeded",
        "context_length_exceeded",
        "context_length_exceeded",
        "invalid_value",
    ]
    assert s.active is None and len(s.token_ids) == 250  # nothing was queued
    for e in errors:  # across processes (a cluster replica's error) they keep type, message, param
        back = pickle.loads(pickle.dumps(e.value))
        assert type(back) is type(e.value) and isinstance(back, PrecacheError)
        assert (str(back), back.param) == (str(e.value), e.value.param)
