"""Block sharing between trajectories: forks hold their parent's blocks (O(1) memory, copy-on-write),
and a new trajectory with a known token prefix takes back the blocks another one published,
exactly where the method's cache definition allows it (DESIGN.md, "The sharing methods")."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.tiny import make_engine

METHODS = [
    "nonshared",
    "fullshared",
    "baseshared",
    "prelrshared",
    "rebaseshared-lp",
    "rebaseshared-db",
    "rebaseownshared-lp",
    "rebaseownshared-db",
]


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("method", METHODS)
def test_a_fork_costs_no_memory_and_outlives_its_parent(tiny, method):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method)
    parent = engine.session()
    parent.append(_ids(1, 37))
    parent.generate("plan", max_new_tokens=4)
    held = engine.cache_usage()["allocated"]
    child = parent.fork(len(parent))
    assert engine.cache_usage()["allocated"] == held  # a fork holds the same blocks
    assert engine.cache_usage()["shared"] == held
    reference = make_engine(model, dirs, method).session()  # the same history, computed again
    reference.append(parent.token_ids[:37])
    reference.generate("plan", max_new_tokens=4)
    extra = _ids(2, 5)
    del parent
    gc.collect()
    for s in (child, reference):
        s.append(extra)
    got, want = child.generate("action", max_new_tokens=3), reference.generate("action", max_new_tokens=3)
    assert got.token_ids == want.token_ids
    assert (got.first_logits - want.first_logits).abs().max() <= 1e-5
    child.check()


def _turn(engine, prompt, agent):
    s = engine.session()
    s.append(prompt)
    return s, s.generate(agent, max_new_tokens=2)


@pytest.mark.parametrize(
    "method",
    [
        "fullshared",
        "prelrshared",
        "rebaseshared-lp",
        "rebaseshared-db",
        "rebaseownshared-lp",
        "rebaseownshared-db",
    ],
)
def test_a_new_trajectory_reuses_published_blocks_whoever_wrote_them(tiny, method):
    """40 common tokens = two full 16-token blocks reused by the second trajectory; its turn then
    equals a session where the first 32 tokens were read by the first agent and it continued."""
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method)
    common = _ids(3, 40)
    first, _ = _turn(engine, common, "plan")
    held = engine.cache_usage()["allocated"]
    second, turn = _turn(engine, common[:40] + _ids(4, 6), "action")
    assert turn.cached_tokens == 32 and turn.prefill_tokens < 14 * (2 if method.endswith("db") else 1) + 1
    assert engine.cache_usage()["shared"] == 2 * engine.pool.block_bytes
    assert engine.cache_usage()["allocated"] < 2 * held
    # the reference: a fresh engine, plan reads the 32 common tokens, then action reads the rest
    fresh = make_engine(model, dirs, method)
    ref = fresh.session()
    ref.append(common[:32])
    ref.generate("plan", max_new_tokens=1)
    ref.sync(second.token_ids[: len(second) - 2])
    want = ref.generate("action", max_new_tokens=2)
    assert want.token_ids == turn.token_ids
    assert (want.first_logits - turn.first_logits).abs().max() <= 1e-5


def test_nonshared_reuses_only_the_same_agents_blocks(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "nonshared")
    common = _ids(5, 40)
    _turn(engine, common, "plan")
    _, other_agent = _turn(engine, common + _ids(6, 3), "action")
    _, same_agent = _turn(engine, common + _ids(7, 3), "plan")
    assert other_agent.cached_tokens == 0 and same_agent.cached_tokens == 32


def test_baseshared_shares_nothing_across_trajectories(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "baseshared")
    common = _ids(8, 40)
    _turn(engine, common, "plan")
    _, turn = _turn(engine, common + _ids(9, 3), "plan")
    assert turn.cached_tokens == 0 and engine.cache_usage()["shared"] == 0


def test_published_blocks_outlive_their_trajectory_until_evicted(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    common = _ids(10, 40)
    first, _ = _turn(engine, common, "plan")
    del first
    gc.collect()
    usage = engine.cache_usage()
    assert usage["allocated"] == 0 and usage["cached"] == 2 * engine.pool.block_bytes  # the 2 full blocks
    _, turn = _turn(engine, common + _ids(11, 3), "reflect")
    assert turn.cached_tokens == 32
