"""Session facts: prefill cost per method, divergence (DESIGN.md fact 6), bad input, streaming."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import precache
from precache.engine import Session
from precache.errors import ContextLengthError, EmptyRequestError, UnknownAdapterError
from precache.methods import METHODS, SELECTIVE_METHODS
from tests.tiny import make_engine, run_script

# the SCRIPT of test_methods: 12 tokens, plan 4, +5, action 3, +4, reflect 3, +3, plan 3, action 2
# NonShared/BaseShared re-read everything the agent has not seen; the others read new tokens only
# (each turn's last token is pending, so the next turn reads it first).
EXPECTED_PREFILL = {
    "nonshared": [12, 21, 28, 19, 14],
    "baseshared": [12, 21, 28, 19, 14],
    "fullshared": [12, 6, 5, 4, 1],
    "prelrshared": [12, 6, 5, 4, 1],
    "rebaseshared-lp": [12, 6, 5, 4, 1],
    "rebaseshared-db": [24, 12, 10, 8, 2],  # the neutral row rides in the same forward
    "rebaseownshared-lp": [12, 6, 5, 4, 1],  # ReBaseShared's prefill: it keeps what that one drops
    "rebaseownshared-db": [24, 12, 10, 8, 2],
    # new tokens + ceil(recomputed token-layers / 3) over the n = 15, 23, 15, 13 tokens the other
    # agents added since the reader's last turn (t0 = 15, 23, 30, 36 minus the reader's view:
    # 0, 0, 15, 23): CacheBlend 2 n + ceil(0.15 n); RelayCaching (layers 1..1) 2 n; DroidSpeak
    # (the tiny adapters' profile picks layer 0..0) n
    "cacheblend": [12, 6 + 11, 5 + 17, 4 + 11, 1 + 10],
    "relaycaching": [12, 6 + 10, 5 + 16, 4 + 10, 1 + 9],
    "droidspeak": [12, 6 + 5, 5 + 8, 4 + 5, 1 + 5],
}


@pytest.mark.parametrize("method", METHODS)
def test_prefill_tokens_per_turn(tiny, method):
    model, dirs, _ = tiny
    s, turns = run_script(make_engine(model, dirs, method))
    assert [t.prefill_tokens for t in turns] == EXPECTED_PREFILL[method]
    if method in SELECTIVE_METHODS:  # no token-layer recomputed twice by one agent: never above NonShared
        assert all(
            a <= b for a, b in zip(EXPECTED_PREFILL[method], EXPECTED_PREFILL["nonshared"], strict=True)
        )
    if method in ("rebaseshared-lp", "rebaseownshared-lp"):
        # the neutral pass reads each processed token exactly once, after the turn
        assert [t.neutral_tokens for t in turns] == [15, 8, 7, 6, 2]
        assert sum(t.neutral_tokens for t in turns) == s.state.base.length == len(s.token_ids) - 1


@pytest.mark.parametrize("method", METHODS)
def test_divergence_cuts_every_cache_to_the_common_prefix(tiny, method):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method)
    s, _ = run_script(engine)
    n = len(s.token_ids)
    before = (
        [t.clone() for t in s.state.stores()[0].kv(0, 0, 10)] if hasattr(s.state.stores()[0], "kv") else None
    )
    diverged = s.token_ids[:10] + [7, 7, 7]
    assert s.sync(diverged) == 10
    assert s.token_ids == diverged and len(s.authors) == 10
    for store in s.state.stores():
        assert store.length <= 10
    if method in ("prelrshared", "rebaseshared-lp", "rebaseshared-db"):
        assert s.state.base.length == 10 and all(lr.length == 10 for lr in s.state.lr.values())
    if before is not None:  # the common prefix is kept as it was
        after = s.state.stores()[0].kv(0, 0, 10)
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    s.check()
    # the session goes on: the next turn equals a fresh session over the same token history
    turn = s.generate(agent="reflect", max_new_tokens=2)
    s.check()
    assert len(turn.token_ids) == 2 and n > 13


def test_continuing_after_divergence_matches_a_fresh_session(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    a = engine.session()
    a.append(list(range(20, 40)))
    a.generate(agent="plan", max_new_tokens=3)
    a.sync(list(range(20, 40)) + [5, 6, 7])  # drops the plan turn's tokens
    t_a = a.generate(agent="action", max_new_tokens=4)
    b = engine.session()
    b.append(list(range(20, 40)))
    b.generate(agent="plan", max_new_tokens=1)  # same author for the first 20 tokens
    b.sync(list(range(20, 40)) + [5, 6, 7])
    t_b = b.generate(agent="action", max_new_tokens=4)
    assert t_a.token_ids == t_b.token_ids
    assert (t_a.first_logits - t_b.first_logits).abs().max() <= 1e-5


def _snapshot(s):
    return list(s.token_ids), s.cache_bytes()["total"], [st.length for st in s.state.stores()]


@pytest.mark.parametrize("method", ["nonshared", "prelrshared", "rebaseshared-db"])
def test_bad_requests_leave_the_session_unchanged(tiny, method):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method)
    empty = engine.session()
    with pytest.raises(EmptyRequestError, match="trajectory is empty"):
        empty.generate(agent="plan")
    s, _ = run_script(engine)
    snap = _snapshot(s)
    with pytest.raises(UnknownAdapterError, match="adapter 'critic' is not loaded"):
        s.generate(agent="critic")
    with pytest.raises(EmptyRequestError, match="max_new_tokens must be at least 1"):
        s.generate(agent="plan", max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        s.generate(agent="plan", temperature=-1.0)
    with pytest.raises(ContextLengthError, match="passes the context length of 256"):
        s.append(list(range(300)))
    assert _snapshot(s) == snap
    s.check()
    assert len(s.generate(agent="plan", max_new_tokens=2).token_ids) == 2  # still usable


def test_generation_stops_at_the_context_length(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    s = engine.session()
    s.append([3] * 250)
    turn = s.generate(agent="plan", max_new_tokens=20)
    assert len(turn.token_ids) == 6 and turn.stop_reason == "length" and len(s) == 256
    with pytest.raises(ContextLengthError, match="256 tokens"):
        s.generate(agent="plan")


def test_stream_yields_the_same_tokens_as_generate(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    a, b = engine.session(), engine.session()
    a.append(list(range(10, 30)))
    b.append(list(range(10, 30)))
    streamed = [chunk.token_id for chunk in a.stream(agent="action", max_new_tokens=5)]
    assert streamed == b.generate(agent="action", max_new_tokens=5).token_ids == a.last_turn.token_ids


def test_sampling_with_a_seed_is_reproducible(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "fullshared")
    outs = []
    for _ in range(2):
        s = engine.session()
        s.append(list(range(10, 30)))
        outs.append(s.generate(agent="plan", max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7).token_ids)
    assert outs[0] == outs[1]


def test_cache_bytes_break_down_by_cache(tiny):
    model, dirs, _ = tiny
    c = model.config
    per_token_kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # K and V, fp32
    engine = make_engine(model, dirs, "prelrshared")
    bs = engine.pool.block_size

    def allocated(n: int) -> int:  # positions of the blocks that hold n tokens
        return -(-n // bs) * bs

    s, _ = run_script(engine)
    n = s.state.base.length
    b = s.cache_bytes()
    assert b["base"] == allocated(n) * per_token_kv
    ranks = {"plan": 4, "action": 8, "reflect": 2}  # k and v both adapted
    assert b["lr"] == {a: allocated(n) * c.num_layers * 2 * r * 4 for a, r in ranks.items()}
    assert b["total"] == b["base"] + sum(b["lr"].values()) and b["peak"] >= b["total"]
    assert engine.cache_usage()["allocated"] == b["total"]  # the only trajectory: every held block is its
    s_ns, _ = run_script(make_engine(model, dirs, "nonshared"))
    full = s_ns.cache_bytes()["full"]
    assert full["plan"] == allocated(s_ns.state.full["plan"].length) * per_token_kv
    # each agent keeps what it has read: plan 36, action 38 and reflect 30 tokens
    assert s_ns.cache_bytes()["total"] == (allocated(36) + allocated(38) + allocated(30)) * per_token_kv


@pytest.mark.parametrize("method", ["nonshared", "prelrshared", "rebaseshared-lp", "rebaseshared-db"])
def test_teacher_forcing_the_greedy_tokens_reproduces_generate(tiny, method):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method, prefix_caching=False)  # both sessions compute every token
    a, b = engine.session(), engine.session()
    for s in (a, b):
        s.append(list(range(10, 30)))
    turn = a.generate(agent="plan", max_new_tokens=6)
    forced = b.teacher_force("plan", turn.token_ids)
    assert forced.token_ids == turn.token_ids and forced.logits.shape == (6, model.config.vocab_size)
    assert forced.logits.argmax(-1).tolist() == turn.token_ids
    assert torch.allclose(forced.logits[0], turn.first_logits)
    assert a.cache_bytes()["total"] == b.cache_bytes()["total"] and a.authors == b.authors
    for layer in range(model.config.num_layers):
        for x, y in zip(
            a.method.view_kv(a.state, "action", layer, len(a) - 1),
            b.method.view_kv(b.state, "action", layer, len(b) - 1),
            strict=True,
        ):
            assert torch.allclose(x, y, atol=1e-6)


@pytest.mark.parametrize("method", ["prelrshared", "rebaseshared-lp"])
def test_an_abandoned_stream_closes_its_turn(tiny, method):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method)
    s = engine.session()
    s.append(list(range(10, 30)))
    stream = s.stream(agent="plan", max_new_tokens=10)
    first = [next(stream).token_id, next(stream).token_id]
    stream.close()  # the consumer walks away after two tokens
    assert s.token_ids[-2:] == first and s.state.turn_start is None
    s.check()  # every LR cache as long as the base again (LP ran its neutral pass)
    assert s.state.base.length == len(s) - 1
    assert len(s.generate(agent="action", max_new_tokens=3).token_ids) == 3


#: list methods that change a list in place
MUTATORS = ("append", "extend", "clear", "pop", "insert", "remove")


def _is_session(node: ast.expr) -> bool:
    """``session``, ``self.session``, ``request.session``, ``victim_session``: an expression named as
    a session."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return "session" in name


def test_only_the_session_writes_its_fields():
    """Every write to a session's fields outside ``engine/session.py`` goes through a Session
    method (``start_turn``, ``release_turn``, ``note_swapped``, ...): no assignment, deletion or
    in-place list change of ``<session>.<field>`` anywhere else in precache/."""
    fields = {f.name for f in dataclasses.fields(Session)}
    root = Path(precache.__file__).parent
    writes = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "engine" / "session.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Assign | ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
            ):
                targets = [node.func.value]
            for target in targets:
                while isinstance(target, ast.Subscript):  # del session.authors[n:]
                    target = target.value
                if isinstance(target, ast.Attribute) and target.attr in fields and _is_session(target.value):
                    writes.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(target)}")
    assert writes == []
