"""run_plans checks a batch's positions on the host, before any block is reserved (the model's
forward no longer reads a device tensor's maximum to do it)."""

import dataclasses

import pytest

from precache.cache.plan import run_plans
from precache.config import SamplingParams
from precache.engine.request import Request
from precache.errors import ContextLengthError
from tests.tiny import make_engine


def test_a_plan_past_the_context_is_refused_before_blocks_are_reserved(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared", prefix_caching=False)
    session = engine.session()
    session.append(list(range(3, 20)))
    request = Request(session, "plan", SamplingParams(max_new_tokens=1))
    request.open()
    plans = request.plans(None)
    before = engine.cache_usage()["allocated"]
    late = [dataclasses.replace(p, pos0=model.max_context - len(p.token_ids) + 1) for p in plans]
    with pytest.raises(ContextLengthError, match=f"past the context length {model.max_context}"):
        run_plans(model, late)
    assert engine.cache_usage()["allocated"] == before
    assert run_plans(model, plans)[0] is not None  # the same plans at their own positions run
