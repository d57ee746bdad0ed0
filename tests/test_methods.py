"""The numbered facts of DESIGN.md for every sharing method, on a tiny random model with random
non-zero LoRA A and B on q, k, v and o, against brute-force references (tests/reference.py)."""

from __future__ import annotations

import pytest
import torch

from precache.methods import METHODS, SELECTIVE_METHODS
from tests.reference import agent_view, base_kv, reference_run
from tests.tiny import AGENTS, SCRIPT, make_engine, run_script

TOL = 1e-4


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float accumulation order: decode steps and batched references sum differently."""
    return torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def check_turn_against_reference(method_name):
    """Fact 2 (and the BaseShared re-read rule): each turn equals a brute-force forward of the agent
    over its turn tokens, reading its materialised view of everything before (the selective-recompute
    baselines: the dense reference of their rule, tests/test_selective_methods.py)."""
    if method_name in SELECTIVE_METHODS:
        from tests.test_selective_methods import check_against_reference

        return check_against_reference

    def on_turn(s, agent):
        m, st = s.method, s.state
        start, n_before = m.prefill_start(st, agent), len(s.token_ids)
        prefix = agent_view(m, st, agent, start)
        reread = None
        if method_name == "baseshared" and st.base.length > start:
            reread = [
                tuple(t.clone() for t in st.base.kv(layer, start, st.base.length))
                for layer in range(m.model.config.num_layers)
            ]

        def after(turn):
            processed = s.token_ids[start : n_before + len(turn.token_ids) - 1]
            logits, h = reference_run(m.model, processed, start, m.adapters[agent], prefix, reread)
            first = n_before - start - 1
            assert (turn.first_logits - logits[first]).abs().max() <= TOL
            assert logits[first:].argmax(-1).tolist() == turn.token_ids[: len(processed) - first]
            after.h = h
            after.span = (start, start + len(processed))
            check_segment_caches(method_name, s, agent, h, start, start + len(processed), n_before)

        return after

    return on_turn


def check_segment_caches(method_name, s, agent, h, start, end, n_before):
    """Fact 4 (PreLRShared: base from h^author, L_a = h^author A_a for all a) and ReBaseShared's own
    segment (L_c = h^c A_c), from the reference's recorded hidden states."""
    m, st = s.method, s.state
    cos, sin = m.model.rope.span(start, end)
    for layer in range(m.model.config.num_layers):
        hl = h[layer]
        if method_name == "prelrshared":
            kb, vb = base_kv(m.model, layer, hl, cos, sin)
            k, v = st.base.kv(layer, start, end)
            assert close(k, kb) and close(v, vb)
            agents = AGENTS
        elif method_name.startswith(("rebaseshared", "rebaseownshared")):
            agents = (agent,)
        else:
            return
        for a in agents:
            adapter = m.adapters[a]
            lk, lv = st.lr[a].lr(layer, start, end)
            assert close(lk, hl @ adapter.weights[(layer, "k_proj")][0])
            assert close(lv, hl @ adapter.weights[(layer, "v_proj")][0])


@pytest.mark.parametrize("method", METHODS)
def test_each_turn_matches_brute_force_reference(tiny, method):
    model, dirs, _ = tiny
    s, turns = run_script(make_engine(model, dirs, method), on_turn=check_turn_against_reference(method))
    assert len(turns) == 5 and all(
        len(t.token_ids) == n
        for t, (w, n) in zip(turns, [x for x in SCRIPT if x[0] != "append"], strict=True)
    )


def _neutral_reference(model, token_ids):
    return reference_run(
        model,
        token_ids,
        0,
        None,
        [
            (torch.zeros(0, model.config.num_kv_heads, model.config.head_dim),) * 2
            for _ in range(model.config.num_layers)
        ],
    )


@pytest.mark.parametrize(
    "method", ["rebaseshared-lp", "rebaseshared-db", "rebaseownshared-lp", "rebaseownshared-db"]
)
@pytest.mark.parametrize("order", [("plan", "action", "reflect"), ("reflect", "reflect", "plan")])
def test_rebaseshared_base_is_the_base_model_cache(tiny, method, order):
    """Fact 3, whatever the order of agents; and L_a = h^0 A_a outside a's own segments."""
    model, dirs, _ = tiny
    script = [("append", 10), (order[0], 3), ("append", 4), (order[1], 4), ("append", 2), (order[2], 3)]
    s, _ = run_script(make_engine(model, dirs, method), script)
    n = s.state.base.length
    assert n == len(s.token_ids) - 1 and all(store.length == n for store in s.state.lr.values())
    _, h0 = _neutral_reference(model, s.token_ids[:n])
    cos, sin = model.rope.span(0, n)
    for layer in range(model.config.num_layers):
        kb, vb = base_kv(model, layer, h0[layer], cos, sin)
        k, v = s.state.base.kv(layer, 0, n)
        assert close(k, kb) and close(v, vb)
        for a in AGENTS:
            others = torch.tensor([author != a for author in s.authors])
            lk, lv = s.state.lr[a].lr(layer, 0, n)
            ref_v = h0[layer] @ s.method.adapters[a].weights[(layer, "v_proj")][0]
            assert close(lv[others], ref_v[others])


@pytest.mark.parametrize("family", ["rebaseshared", "rebaseownshared"])
def test_lp_and_db_generate_the_same_tokens_and_caches(tiny, family):
    """Fact 5: the two ReBaseShared schedules differ only in when the neutral pass runs (likewise
    ReBaseOwnShared's, which runs the same neutral pass)."""
    model, dirs, _ = tiny
    s_lp, t_lp = run_script(make_engine(model, dirs, f"{family}-lp"))
    s_db, t_db = run_script(make_engine(model, dirs, f"{family}-db"))
    assert [t.token_ids for t in t_lp] == [t.token_ids for t in t_db]
    for layer in range(model.config.num_layers):
        n = s_lp.state.base.length
        for x, y in zip(s_lp.state.base.kv(layer, 0, n), s_db.state.base.kv(layer, 0, n), strict=True):
            assert torch.allclose(x, y, atol=1e-5, rtol=1e-5)
        for a in AGENTS:
            for x, y in zip(s_lp.state.lr[a].lr(layer, 0, n), s_db.state.lr[a].lr(layer, 0, n), strict=True):
                assert torch.allclose(x, y, atol=1e-5, rtol=1e-5)
    assert all(t.neutral_tokens > 0 for t in t_lp) and all(t.neutral_tokens == 0 for t in t_db)


@pytest.mark.parametrize("method", METHODS)
def test_zero_lora_b_equals_nonshared(tiny, method):
    """Fact 1: with every LoRA B = 0, every method is NonShared."""
    model, _, zero = tiny
    _, ref = run_script(make_engine(model, zero, "nonshared"))
    _, got = run_script(make_engine(model, zero, method))
    for r, g in zip(ref, got, strict=True):
        assert g.token_ids == r.token_ids
        assert (g.first_logits - r.first_logits).abs().max() <= TOL


@pytest.mark.parametrize("method", METHODS)
def test_single_agent_equals_nonshared_except_rebase(tiny, method):
    """Fact 1: with one agent, every method but ReBaseShared is NonShared (ReBaseOwnShared reads
    every earlier segment from its own exact K/V then: NonShared too)."""
    model, dirs, _ = tiny
    script = [("append", 9), ("plan", 4), ("append", 6), ("plan", 5), ("append", 3), ("plan", 3)]
    _, ref = run_script(make_engine(model, dirs, "nonshared"), script)
    _, got = run_script(make_engine(model, dirs, method), script)
    diffs = [(g.first_logits - r.first_logits).abs().max().item() for g, r in zip(got, ref, strict=True)]
    if method.startswith("rebaseshared"):
        assert diffs[0] <= TOL and max(diffs[1:]) > 1e-3  # first turn is exact; later ones read h^0 bases
    else:
        assert max(diffs) <= TOL


def test_nonshared_equals_the_dense_forward_of_each_agent(tiny):
    """NonShared keeps each agent's own cache: its incremental turns equal a full forward."""
    model, dirs, _ = tiny
    from precache.models import dense_logits

    def on_turn(s, agent):
        n_before = len(s.token_ids)

        def after(turn):
            ref = dense_logits(model, [s.token_ids[:n_before]], [s.method.adapters[agent]])[0][-1]
            assert (turn.first_logits - ref).abs().max() <= TOL

        return after

    run_script(make_engine(model, dirs, "nonshared"), on_turn=on_turn)
