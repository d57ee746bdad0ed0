"""ReBaseOwnShared against its brute-force oracle (DESIGN.md, "ReBaseOwnShared"), on a tiny random
model with random LoRA A and B on q, k, v and o; and the facts of DESIGN.md that apply to it.

The oracle never reads the engine's caches: one dense adapter-free forward over the whole
trajectory gives ``h^0``; each turn is then a dense forward of its agent that attends to its own
earlier turns' exact K/V (recorded by the oracle's own earlier forwards) and to
``Kb(h^0) + RoPE(s h^0 A^k B^k)``, ``Vb(h^0) + s h^0 A^v B^v`` everywhere else."""

from __future__ import annotations

import pytest
import torch

from tests.reference import base_kv, lora_view, reference_run
from tests.tiny import AGENTS, make_engine, run_script

TOL = 1e-4

#: every agent takes several turns, two of them back to back, with new tokens in between most
LONG_SCRIPT = [
    ("append", 9),
    ("plan", 4),
    ("append", 3),
    ("action", 3),
    ("append", 5),
    ("reflect", 2),
    ("plan", 3),
    ("append", 4),
    ("action", 4),
    ("action", 2),
    ("append", 2),
    ("reflect", 3),
    ("append", 3),
    ("plan", 3),
]


def _lr(adapter, layer, h, proj):
    return h @ adapter.weights[(layer, proj)][0] if adapter.has(layer, proj) else None


def oracle(model, adapters, token_ids, turns):
    """Per turn ``(agent, n_before, n_generated)``: the oracle's logits ``[processed, vocab]`` over
    the tokens the turn processes, which start where the previous turn's stopped."""
    L, n = model.config.num_layers, len(token_ids)
    empty = [(torch.zeros(0, model.config.num_kv_heads, model.config.head_dim),) * 2] * L
    _, h0 = reference_run(model, token_ids, 0, None, empty)
    cos, sin = model.rope.span(0, n)
    base = [base_kv(model, layer, h0[layer], cos, sin) for layer in range(L)]
    own: dict[str, list] = {}  # agent -> [(start, end, [(K, V) per layer])]
    out, start = [], 0
    for agent, n_before, n_generated in turns:
        adapter = adapters[agent]
        prefix = []
        for layer in range(L):
            hl = h0[layer][:start]
            kb, vb = base[layer][0][:start], base[layer][1][:start]
            k, v = lora_view(
                model,
                adapter,
                layer,
                kb,
                vb,
                _lr(adapter, layer, hl, "k_proj"),
                _lr(adapter, layer, hl, "v_proj"),
                0,
            )
            for s, e, kv in own.get(agent, []):
                k[s:e], v[s:e] = kv[layer]
            prefix.append((k, v))
        processed = token_ids[start : n_before + n_generated - 1]
        logits, h = reference_run(model, processed, start, adapter, prefix)
        end = start + len(processed)
        cs, sn = model.rope.span(start, end)
        kv = []
        for layer in range(L):
            kb, vb = base_kv(model, layer, h[layer], cs, sn)
            lk, lv = _lr(adapter, layer, h[layer], "k_proj"), _lr(adapter, layer, h[layer], "v_proj")
            kv.append(lora_view(model, adapter, layer, kb, vb, lk, lv, start))
        own.setdefault(agent, []).append((start, end, kv))
        out.append((start, logits))
        start = end
    return out


@pytest.mark.parametrize("method", ["rebaseownshared-lp", "rebaseownshared-db"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_every_turn_equals_the_brute_force_oracle(tiny, method, block_size):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method, block_size=block_size)
    before = []
    s, turns = run_script(
        engine, LONG_SCRIPT, on_turn=lambda s, agent: before.append(len(s.token_ids)) or None
    )
    record = [(t.agent, n, len(t.token_ids)) for t, n in zip(turns, before, strict=True)]
    ref = oracle(model, engine.adapters, s.token_ids, record)
    for turn, n_before, (start, logits) in zip(turns, before, ref, strict=True):
        first = n_before - start - 1
        assert (turn.first_logits - logits[first]).abs().max() <= TOL, turn.agent
        assert logits[first:].argmax(-1).tolist() == turn.token_ids[: logits.shape[0] - first]


def test_it_differs_from_both_paper_methods(tiny):
    """The oracle is not one of the paper's methods in disguise: on the same script some turn
    differs from ReBaseShared (own segments) and from PreLRShared (the others' segments)."""
    model, dirs, _ = tiny
    _, own = run_script(make_engine(model, dirs, "rebaseownshared-lp"), LONG_SCRIPT)
    for other in ("rebaseshared-lp", "prelrshared"):
        _, turns = run_script(make_engine(model, dirs, other), LONG_SCRIPT)
        assert (
            max((a.first_logits - b.first_logits).abs().max() for a, b in zip(own, turns, strict=True)) > 1e-3
        )


def test_own_segments_are_held_as_one_store_per_turn(tiny):
    """Memory: the base, every LR cache, and each agent's own turns in full, one store per turn
    covering exactly the positions that turn processed (together: the whole trajectory)."""
    model, dirs, _ = tiny
    s, turns = run_script(make_engine(model, dirs, "rebaseownshared-lp", block_size=4), LONG_SCRIPT)
    st, m = s.state, s.method
    spans = sorted((own.offset, own.length, key.rsplit("@", 1)[0]) for key, own in st.full.items())
    assert [a for _, _, a in spans] == [t.agent for t in turns]
    assert spans[0][0] == 0 and spans[-1][1] == st.base.length == len(s.token_ids) - 1
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # the turns tile the trajectory
    used = s.cache_bytes()
    assert used["full"] == {key: own.nbytes() for key, own in st.full.items()}
    assert sum(used["full"].values()) >= m.pool.block_bytes * m.pool.blocks_for(st.base.length)


def test_dropping_an_agent_drops_its_own_segments(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "rebaseownshared-lp", max_adapters=3)
    s, _ = run_script(engine, LONG_SCRIPT)
    held = engine.pool.usage()["allocated"]
    plan_blocks = sum(len(own.blocks) for key, own in s.state.full.items() if key.startswith("plan@"))
    engine.remove_adapter("plan")
    s.method.sync_state(s.state)
    assert not any(key.startswith("plan@") for key in s.state.full)
    assert engine.pool.usage()["allocated"] == held - plan_blocks * engine.pool.block_bytes
    assert set(AGENTS) - {"plan"} == {key.rsplit("@", 1)[0] for key in s.state.full}
