"""Adapters added and removed at run time (DESIGN.md, "Adapters loaded at run time"), under every
sharing method, on a tiny random model with random LoRA A and B on q, k, v and o.

Oracles: an engine that had the adapter from the start (the method's own cache definition, so an
added adapter's caches must come out as if it had always been there), NonShared, and HF + PEFT for
a fresh trajectory."""

from __future__ import annotations

import pytest
import torch

import precache
from precache.engine.request import Request
from precache.errors import (
    AdapterBusyError,
    AdapterError,
    AdapterLimitError,
    CacheCapacityError,
    UnknownAdapterError,
)
from precache.methods import METHODS
from tests.tiny import close, make_engine, peft_logits, save_random_adapter, tiny_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
EARLY = [("append", 12), ("plan", 4), ("append", 5), ("action", 3)]
LATE = [("append", 4), ("reflect", 3), ("append", 3), ("plan", 3), ("reflect", 2), ("action", 2)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, hf = tiny_model("llama", seed=0, num_layers=3)
    root = tmp_path_factory.mktemp("runtime-adapters")
    dirs = {
        a: save_random_adapter(hf, root / a, targets=TARGETS, r=r, seed=i + 1)
        for i, (a, r) in enumerate(zip(("plan", "action", "reflect"), (4, 8, 2), strict=True))
    }
    dirs["reflect2"] = save_random_adapter(hf, root / "reflect2", targets=TARGETS, r=4, seed=11)
    dirs["wide"] = save_random_adapter(hf, root / "wide", targets=TARGETS, r=32, seed=12)
    return model, hf, dirs


def replay(engine, script, session=None, seed=123):
    """Replay ``script`` (as tests.tiny.run_script) on ``session``; return it and its turns."""
    s = session or engine.session()
    gen = torch.Generator().manual_seed(seed)
    turns = []
    for what, n in script:
        if what == "append":
            s.append(torch.randint(0, 90, (n,), generator=gen).tolist())
            continue
        turns.append(s.generate(agent=what, max_new_tokens=n, temperature=0.0))
        s.check()
    return s, turns


def assert_same_turns(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert close(a.first_logits, b.first_logits), (a.agent, (a.first_logits - b.first_logits).abs().max())


#: the methods whose published base blocks hold every loaded agent's LR rows
LR_FOR_ALL = ("prelrshared", "rebaseshared-lp", "rebaseshared-db", "rebaseownshared-lp", "rebaseownshared-db")


@pytest.mark.parametrize("method", METHODS)
def test_added_adapter_reads_the_caches_it_would_have_had_from_the_start(setup, method):
    """A trajectory started before ``reflect`` was loaded, and a second one over the same first
    blocks (prefix reuse), go on exactly as on an engine that had ``reflect`` from the start; the
    catch-up is counted in the added agent's first ``prefill_tokens``."""
    model, _, dirs = setup
    three = {a: dirs[a] for a in ("plan", "action", "reflect")}
    ref = make_engine(model, three, method, max_adapters=3)
    live = make_engine(model, {a: dirs[a] for a in ("plan", "action")}, method, max_adapters=3)
    if method == "droidspeak":  # one profiled range for both (it belongs to the adapter set)
        ref.method.layers_given = live.method.layers_given = True
        live.method.layers = ref.method.layers
    s_ref, early_ref = replay(ref, EARLY)
    s_live, early_live = replay(live, EARLY)
    assert_same_turns(early_live, early_ref)
    live.add_adapter("reflect", dirs["reflect"])
    # a new trajectory over the same first block: under PreLRShared and ReBaseShared the block
    # published before the adapter was loaded holds no LR rows for it and must not be taken, so the
    # reference reads nothing published either (a fresh tenant); the others reuse it on both engines
    split = method in LR_FOR_ALL
    turns = []
    for engine, first in ((ref, s_ref), (live, s_live)):
        s = engine.session(cache_salt="fresh" if split and engine is ref else None)
        s.append(first.token_ids[:20])  # a full block published before the add, and 4 tokens more
        turns.append(s.generate(agent="reflect", max_new_tokens=2, temperature=0.0))
    if split:
        assert (turns[0].cached_tokens, turns[1].cached_tokens) == (0, 0)
    assert_same_turns(turns[1:], turns[:1])
    _, late_ref = replay(ref, LATE, s_ref)
    _, late_live = replay(live, LATE, s_live)
    assert_same_turns(late_live, late_ref)
    first_ref, first_live = late_ref[0], late_live[0]
    if method in LR_FOR_ALL:
        # the catch-up re-runs what came before the turn, once, for the new agent's LR cache
        assert first_live.prefill_tokens == first_ref.prefill_tokens + first_ref.cached_tokens
    else:
        assert first_live.prefill_tokens == first_ref.prefill_tokens


@pytest.mark.parametrize("method", METHODS)
def test_added_adapter_first_turn_equals_peft_and_nonshared(setup, method):
    """A fresh trajectory's first turn of an adapter loaded into a running engine: HF + PEFT's
    logits, and NonShared's."""
    model, hf, dirs = setup
    engine = make_engine(model, {"plan": dirs["plan"]}, method, max_adapters=2)
    replay(engine, EARLY[:2])  # the engine has served before
    engine.add_adapter("reflect", dirs["reflect"])
    nonshared = make_engine(model, {"reflect": dirs["reflect"]}, "nonshared")
    ids = torch.randint(0, 90, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    turns = []
    for e in (engine, nonshared):
        s = e.session()
        s.append(ids)
        turns.append(s.generate(agent="reflect", max_new_tokens=3, temperature=0.0))
    oracle = peft_logits(hf, dirs["reflect"], ids)[-1]
    assert (turns[0].first_logits - oracle).abs().max() <= 1e-4
    assert_same_turns(turns[:1], turns[1:])


@pytest.mark.parametrize("method", METHODS)
def test_unload_and_load_again_under_the_same_name_drops_the_old_caches(setup, method):
    """``reflect`` unloaded and a different adapter loaded under its name: the trajectory's caches
    of the old one (under split methods, its LR rows written by the other agents' forwards) are
    dropped, and the new one reads what it would have read had it been loaded from the start."""
    model, _, dirs = setup
    three = {a: dirs[a] for a in ("plan", "action", "reflect")}
    # reflect2's rank 4 does not fit reflect's rank-2 columns: a spare slot takes it
    live = make_engine(model, three, method, max_adapters=4)
    ref = make_engine(model, {**three, "reflect": dirs["reflect2"]}, method, max_adapters=4)
    if method == "droidspeak":
        ref.method.layers_given = live.method.layers_given = True
        live.method.layers = ref.method.layers
    s, _ = replay(live, EARLY)
    s_ref, _ = replay(ref, EARLY)
    live.remove_adapter("reflect")
    with pytest.raises(UnknownAdapterError):
        s.generate(agent="reflect", max_new_tokens=1)
    live.add_adapter("reflect", dirs["reflect2"])
    _, got = replay(live, LATE, s)
    _, want = replay(ref, LATE, s_ref)
    assert_same_turns(got, want)


@pytest.mark.parametrize("method", METHODS)
def test_a_trajectory_forked_after_an_unload_goes_on_as_one_never_forked(setup, method):
    """A trajectory written while ``reflect`` was loaded, forked after its unload (a server's
    pooled session taking a new request): the fork holds only the loaded agents' caches (the
    unloaded one's LR columns are gone from the pool) and its next turns equal the parent's.
    Found by the server fuzzer (tests/test_server_fuzz.py): the fork raised KeyError."""
    model, _, dirs = setup
    three = {a: dirs[a] for a in ("plan", "action", "reflect")}
    sessions = []
    for _ in range(2):  # two engines with the same history (a fork's turns publish blocks too)
        engine = make_engine(model, three, method, max_adapters=4)
        if method == "droidspeak":
            engine.method.layers_given = True
        s, _ = replay(engine, [*EARLY, ("reflect", 2)])
        engine.remove_adapter("reflect")
        sessions.append(s)
    fork = sessions[0].fork(len(sessions[0].token_ids))
    assert "reflect" not in fork.state.lr and "reflect" not in fork.state.uids
    after = [("append", 4), ("plan", 3), ("action", 2)]
    _, got = replay(fork.engine, after, fork, seed=7)
    twin = sessions[1]
    if method == "cacheblend":  # its fork parts from its parent with no unload at all (the
        twin = twin.fork(len(twin.token_ids))  # recompute's top 15% differs): a fork on each side
    _, want = replay(twin.engine, after, twin, seed=7)
    assert_same_turns(got, want)


def test_nonshared_reload_reads_nothing_of_the_old_load(setup):
    """NonShared: the old ``reflect`` read the trajectory; the new one under its name prefills it
    all again with its own weights (HF + PEFT's logits), its old cache dropped."""
    model, hf, dirs = setup
    live = make_engine(model, {a: dirs[a] for a in ("plan", "reflect")}, "nonshared")
    s, _ = replay(live, [("append", 20), ("reflect", 3), ("append", 4), ("plan", 2), ("append", 3)])
    live.remove_adapter("reflect")
    live.add_adapter("reflect", dirs["reflect2"])
    # a new trajectory over the same first block: the old load's published block is not taken
    other = live.session()
    other.append(s.token_ids[:20])
    again = other.generate(agent="reflect", max_new_tokens=1, temperature=0.0)
    assert again.cached_tokens == 0
    assert (again.first_logits - peft_logits(hf, dirs["reflect2"], s.token_ids[:20])[-1]).abs().max() <= 1e-4
    turn = s.generate(agent="reflect", max_new_tokens=2, temperature=0.0)
    s.check()
    assert turn.cached_tokens == 16  # only the block the new load published just now
    oracle = peft_logits(hf, dirs["reflect2"], s.token_ids[: turn.prompt_tokens])[-1]
    assert (turn.first_logits - oracle).abs().max() <= 1e-4


def test_unloading_an_adapter_in_use_is_refused(setup):
    model, _, dirs = setup
    engine = make_engine(model, {"plan": dirs["plan"]}, "prelrshared")
    s = engine.session()
    s.append(list(range(10)))
    request = engine.submit(Request(s, "plan", s.validate("plan", {"max_new_tokens": 3})))
    with pytest.raises(AdapterBusyError, match="plan"):
        engine.remove_adapter("plan")
    engine.wait(request)
    engine.remove_adapter("plan")
    assert "plan" not in engine.adapters
    with pytest.raises(UnknownAdapterError):
        engine.remove_adapter("plan")


def test_bad_adds_are_refused_with_the_reason(setup, tmp_path):
    model, _, dirs = setup
    split = make_engine(model, {"plan": dirs["plan"]}, "prelrshared")  # no spare LR slot
    with pytest.raises(CacheCapacityError, match="max_adapters"):
        split.add_adapter("action", dirs["action"])
    assert "action" not in split.adapters and "action" not in split.pool.lr_cols
    roomy = make_engine(model, {"plan": dirs["plan"]}, "prelrshared", max_adapters=2, max_lora_rank=8)
    with pytest.raises(AdapterError, match="max_lora_rank"):
        roomy.add_adapter("wide", dirs["wide"])
    with pytest.raises(AdapterError, match="loaded already"):
        roomy.add_adapter("plan", dirs["action"])
    with pytest.raises(AdapterError):
        roomy.add_adapter("x", tmp_path / "missing")
    with pytest.raises(AdapterError):
        roomy.add_adapter("", dirs["action"])
    # NonShared and FullShared keep no LR columns: no slot is needed
    full = make_engine(model, {"plan": dirs["plan"]}, "fullshared")
    full.add_adapter("wide", dirs["wide"])
    assert "wide" in full.adapters


def test_lr_slots_are_reused_after_an_unload(setup):
    """The freed columns of an unloaded adapter take the next one (rank 2 into action's rank-8
    columns); the blocks hold the old one's LR rows, which the catch-up overwrites: the new agent
    reads what an engine that had it from the start gives."""
    model, _, dirs = setup
    script = [("append", 12), ("plan", 4), ("append", 5)]
    engine = make_engine(model, {"plan": dirs["plan"], "action": dirs["action"]}, "prelrshared")
    s, _ = replay(engine, script)
    engine.remove_adapter("action")
    engine.add_adapter("reflect", dirs["reflect"])
    assert engine.pool.lr_cols["reflect"][0].start == engine.pool.lr_width - 16  # action's columns
    ref = make_engine(model, {"plan": dirs["plan"], "reflect": dirs["reflect"]}, "prelrshared")
    s_ref, _ = replay(ref, script)
    _, got = replay(engine, [("reflect", 3), ("append", 2), ("plan", 2)], s)
    _, want = replay(ref, [("reflect", 3), ("append", 2), ("plan", 2)], s_ref)
    assert_same_turns(got, want)


def test_engine_options_are_checked(setup):
    model, _, dirs = setup
    with pytest.raises(ValueError, match="max_adapters"):
        precache.Engine(model, adapters={"plan": dirs["plan"], "action": dirs["action"]}, max_adapters=1)
    with pytest.raises(ValueError, match="max_lora_rank"):
        precache.Engine(model, adapters={"action": dirs["action"]}, max_lora_rank=4)


@pytest.mark.parametrize("method", ["nonshared", "fullshared", "prelrshared"])
def test_max_adapters_and_max_lora_rank_bound_every_method(setup, method):
    """Given bounds hold under every method, not only where they size LR columns."""
    model, _, dirs = setup
    engine = make_engine(model, {"plan": dirs["plan"]}, method, max_adapters=2, max_lora_rank=8)
    with pytest.raises(AdapterLimitError, match="max_lora_rank=8"):
        engine.add_adapter("wide", dirs["wide"])  # rank 32
    engine.add_adapter("action", dirs["action"])  # rank 8: the second of two
    with pytest.raises(AdapterLimitError, match="max_adapters=2"):
        engine.add_adapter("reflect", dirs["reflect"])
    assert set(engine.adapters) == {"plan", "action"}
    engine.remove_adapter("action")
    engine.add_adapter("reflect", dirs["reflect"])  # room again
    assert set(engine.adapters) == {"plan", "reflect"}
