"""The selective-recomputation baselines (CacheBlend, DroidSpeak, RelayCaching) against a dense
brute-force reference of each rule, on a tiny random model with random LoRA on q, k, v and o:
each turn's logits and tokens, rho = 1 / every layer = NonShared, the prefill cost equal to the
token-layers the forward ran, concurrency, the recompute hook's refusals and the stored profile."""

from __future__ import annotations

import json
import math

import pytest
import torch

from precache.cache.rowplan import Recompute
from precache.engine.scheduler import Scheduler, SchedulerConfig
from precache.methods import SELECTIVE_METHODS, make_method
from precache.methods.cacheblend import CacheBlend
from precache.methods.droidspeak import DroidSpeak, profile, read_profile, save_profile
from precache.methods.relaycaching import RelayCaching
from precache.models import Row
from tests.reference import base_kv, lora_view, reference_run
from tests.tiny import SCRIPT, close, make_engine, run_script

TOL = 1e-4
AGENT_TURNS = [x for x in SCRIPT if x[0] != "append"]


def engine_with(model, dirs, cls, **options):
    """An engine whose sharing method is ``cls(**options)`` (the registry builds defaults only)."""
    engine = make_engine(model, dirs, "fullshared", block_size=4)
    engine.method = cls(model, engine.adapters, engine.pool, **options)  # a pool without LR columns
    engine.scheduler = Scheduler(engine._forward, pool=engine.pool)
    return engine


def schedule_of(method):
    """``(select_layer, kept(n), fresh(layer, selected, n) -> bool [n])``: which reused tokens get
    the agent's own K/V at each layer, restated from each module's docstring."""
    L = method.model.config.num_layers
    everything, nothing = (
        (lambda n: torch.ones(n, dtype=torch.bool)),
        (lambda n: torch.zeros(n, dtype=torch.bool)),
    )
    if isinstance(method, CacheBlend):
        c = method.check_layer
        return (
            c,
            lambda n: math.ceil(method.rho * n),
            lambda layer, sel, n: everything(n) if layer <= c else sel,
        )
    if isinstance(method, DroidSpeak):
        a, b = method.layers
        return None, None, lambda layer, sel, n: everything(n) if a <= layer <= b else nothing(n)
    a, b = method.layers
    assert isinstance(method, RelayCaching) and b < L

    def fresh(layer, sel, n):
        if layer == a:
            return everything(n)
        return sel if a < layer <= b else nothing(n)

    return (a if a < b else None), lambda n: math.ceil(method.rho * n), fresh


class BlendReference:
    """Dense brute force of a recompute rule over reused tokens at positions ``[r0, r0 + n)``,
    after the agent's earlier view ``prefix[l] = (K, V)`` ``[r0, Hkv, D]``: every layer computes the
    agent's K/V for all of them, takes its own where the rule says so and the reused entries
    elsewhere, and attends (causal, explicit softmax, the layer's sliding window) over the prefix
    and that blend. ``blend[l]`` = (K, V) of the reused tokens."""

    def __init__(self, method, adapter, reused, prefix):
        self.adapter, self.reused, self.prefix = adapter, reused, prefix
        self.select_layer, self.kept, self.fresh = schedule_of(method)
        self.selected, self.blend = None, []

    def attend(self, x):
        k, v = x.adapted_kv(slice(None), self.adapter)
        rk, rv = self.reused[x.layer]
        n = k.shape[0]
        if x.layer == self.select_layer:
            dev = (k - rk).pow(2).flatten(1).sum(1) + (v - rv).pow(2).flatten(1).sum(1)
            self.selected = torch.zeros(n, dtype=torch.bool)
            self.selected[torch.topk(dev, self.kept(n)).indices] = True
        own = self.fresh(x.layer, self.selected, n)[:, None, None]
        k, v = torch.where(own, k, rk), torch.where(own, v, rv)
        self.blend.append((k, v))
        pk, pv = self.prefix[x.layer]
        P = pk.shape[0]
        G = x.q.shape[1] // k.shape[1]
        kk = torch.cat([pk, k]).repeat_interleave(G, dim=1)
        vv = torch.cat([pv, v]).repeat_interleave(G, dim=1)
        scores = torch.einsum("thd,nhd->htn", x.q, kk) / math.sqrt(x.q.shape[2])
        keys, queries = torch.arange(P + n)[None, :], P + torch.arange(n)[:, None]
        mask = keys <= queries
        window = x.model.config.window(x.layer)  # sliding window: key p visible when p > t - window
        if window is not None:
            mask &= keys > queries - window
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("htn,nhd->thd", probs, vv).reshape(n, -1)


def blended_view(method, adapter, token_ids, r0, reused, prefix):
    """The reference blend of the reused tokens ``token_ids`` at positions ``[r0, r0 + n)``."""
    ref = BlendReference(method, adapter, reused, prefix)
    n = len(token_ids)
    method.model.forward(
        torch.tensor(token_ids), torch.arange(r0, r0 + n), [Row(0, n, adapter)], ref, logits_at=[n - 1]
    )
    return ref.blend


def _cat(a, b):
    return [(torch.cat([x[0], y[0]]), torch.cat([x[1], y[1]])) for x, y in zip(a, b, strict=True)]


def reference_checker():
    """``on_turn`` for :func:`run_script`: the reference keeps each agent's view across its turns
    (its own turns' exact K/V, the others' segments as its rule blended them). Before a turn: the
    shared cache's entries of the segments new since the agent's last turn; after it: the turn's
    logits and tokens equal a dense forward over the agent's reference view, and the engine's view
    of the agent equals the reference's."""
    views: dict = {}

    def on_turn(s, agent):
        m, st = s.method, s.state
        L = m.model.config.num_layers
        t0, n_before = m.prefill_start(st, agent), len(s.token_ids)
        empty = [(torch.zeros(0, m.model.config.num_kv_heads, m.model.config.head_dim),) * 2] * L
        prefix = views.get(agent, empty)
        r0 = prefix[0][0].shape[0]
        shared = st.full["shared"]
        reused = [tuple(t.clone() for t in shared.kv(layer, r0, t0)) for layer in range(L)]
        trajectory = list(s.token_ids[r0:t0])

        def after(turn):
            adapter = m.adapters[agent]
            blend = blended_view(m, adapter, trajectory, r0, reused, prefix) if t0 > r0 else empty
            before = _cat(prefix, blend)
            processed = s.token_ids[t0 : n_before + len(turn.token_ids) - 1]
            logits, h = reference_run(m.model, processed, t0, adapter, before)
            first = n_before - t0 - 1
            assert (turn.first_logits - logits[first]).abs().max() <= TOL
            assert logits[first:].argmax(-1).tolist() == turn.token_ids[: len(processed) - first]
            end = t0 + len(processed)
            cos, sin = m.model.rope.span(t0, end)
            own = []
            for layer in range(L):
                kb, vb = base_kv(m.model, layer, h[layer], cos, sin)
                lk = h[layer] @ adapter.weights[(layer, "k_proj")][0]
                lv = h[layer] @ adapter.weights[(layer, "v_proj")][0]
                own.append(lora_view(m.model, adapter, layer, kb, vb, lk, lv, t0))
            views[agent] = _cat(before, own)
            for layer in range(L):
                k, v = m.view_kv(st, agent, layer, end)
                assert close(k, views[agent][layer][0]) and close(v, views[agent][layer][1])
            after.checked = True

        return after

    return on_turn


def check_against_reference(s, agent):
    """One turn checked against the reference of its rule, the agent's view carried by the session
    (tests/test_methods.py runs every method's turns through one hook per turn)."""
    checkers = s.__dict__.setdefault("_reference_checker", reference_checker())
    return checkers(s, agent)


VARIANTS = [
    (CacheBlend, {}),
    (CacheBlend, {"rho": 0.3, "check_layer": 0}),
    (DroidSpeak, {"layers": (1, 1)}),
    (DroidSpeak, {"layers": (0, 1)}),
    (RelayCaching, {}),
    (RelayCaching, {"rho": 0.4, "layers": (0, 1)}),
]


@pytest.mark.parametrize(("cls", "options"), VARIANTS)
def test_each_turn_matches_the_dense_reference_of_its_rule(tiny, cls, options):
    model, dirs, _ = tiny
    engine = engine_with(model, dirs, cls, **options)
    calls, checker = [], reference_checker()

    def on_turn(s, agent):
        after = checker(s, agent)
        calls.append(after)
        return after

    _, turns = run_script(engine, on_turn=on_turn)
    assert len(turns) == len(AGENT_TURNS) and all(getattr(a, "checked", False) for a in calls)


def test_selection_differs_from_full_reuse_and_from_full_recompute(tiny):
    """The rule does something: CacheBlend's turns lie strictly between FullShared and NonShared."""
    model, dirs, _ = tiny
    _, ref = run_script(make_engine(model, dirs, "nonshared"))
    _, full = run_script(make_engine(model, dirs, "fullshared"))
    _, blend = run_script(engine_with(model, dirs, CacheBlend, rho=0.3, check_layer=0))
    for r, f, b in zip(ref[1:], full[1:], blend[1:], strict=True):
        to_full = (b.first_logits - f.first_logits).abs().max()
        to_ref = (b.first_logits - r.first_logits).abs().max()
        assert to_full > 1e-3 and to_ref > 1e-3


ALL_LAYERS = [
    (CacheBlend, {"rho": 1.0}),
    (CacheBlend, {"rho": 1.0, "check_layer": 0}),
    (DroidSpeak, {"layers": (0, 2)}),
    (RelayCaching, {"rho": 1.0, "layers": (0, 2)}),
]


@pytest.mark.parametrize(("cls", "options"), ALL_LAYERS)
def test_recomputing_everything_equals_nonshared(tiny, cls, options):
    """rho = 100% / every layer: each turn is the agent's own full recompute (NonShared's logits)."""
    model, dirs, _ = tiny
    _, ref = run_script(make_engine(model, dirs, "nonshared"))
    _, got = run_script(engine_with(model, dirs, cls, **options))
    for r, g in zip(ref, got, strict=True):
        assert g.token_ids == r.token_ids
        assert (g.first_logits - r.first_logits).abs().max() <= TOL


# B = 0 equals NonShared at the defaults: tests/test_methods.py::test_zero_lora_b_equals_nonshared
# runs over every method, these included.


class LayerCounter:
    """Counts the token-layers the model runs (tokens entering each layer's MLP)."""

    def __init__(self, model, monkeypatch):
        self.total = 0
        original = model._mlp

        def counted(x, i, rows):
            self.total += x.shape[0]
            return original(x, i, rows)

        monkeypatch.setattr(model, "_mlp", counted)


@pytest.mark.parametrize(("cls", "options"), VARIANTS + ALL_LAYERS)
def test_prefill_tokens_count_the_token_layers_the_forward_ran(tiny, monkeypatch, cls, options):
    """A turn's ``prefill_tokens`` = new tokens + ceil(recomputed token-layers / L), where the
    token-layers are counted in the model itself; the recompute runs in the turn's TTFT."""
    model, dirs, _ = tiny
    L = model.config.num_layers
    engine = engine_with(model, dirs, cls, **options)
    counter = LayerCounter(model, monkeypatch)
    s = engine.session()
    s.append(list(range(1, 15)))
    first = s.generate(agent="plan", max_new_tokens=3, temperature=0.0)
    s.append(list(range(20, 26)))
    before, t0, n = counter.total, s.method.prefill_start(s.state, "action"), len(s.token_ids)
    turn = s.generate(agent="action", max_new_tokens=1, temperature=0.0)  # one forward: the prefill
    ran = counter.total - before
    new = n - t0
    assert first.prefill_tokens == 14 and t0 == 16 and new == 7
    assert ran > new * L  # the recompute ran inside the turn
    assert turn.prefill_tokens == new + math.ceil((ran - new * L) / L)
    assert turn.cached_tokens == t0


@pytest.mark.parametrize("method", SELECTIVE_METHODS)
def test_concurrent_sessions_equal_sequential_ones(tiny, method):
    """Three 3-agent trajectories batched by Engine.run_concurrently give the sequential logits (on
    a second engine: on the first, the views published by the sequential runs would be reused, and
    a recompute that starts later selects among fewer tokens)."""
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method)

    def trajectory(seed):
        s = engine.session()
        gen = torch.Generator().manual_seed(seed)
        out = []
        for agent, n_append, n_new in [("plan", 11, 3), ("action", 5, 3), ("reflect", 4, 2), ("plan", 3, 2)]:
            s.append(torch.randint(0, 90, (n_append,), generator=gen).tolist())
            t = s.generate(agent=agent, max_new_tokens=n_new, temperature=0.0)
            out.append((t.token_ids, t.first_logits))
        return out

    alone = [trajectory(seed) for seed in (1, 2, 3)]
    engine = make_engine(model, dirs, method)
    batched = engine.run_concurrently(trajectory, (1, 2, 3), concurrency=3)
    for a, b in zip(alone, batched, strict=True):
        for (ids_a, logits_a), (ids_b, logits_b) in zip(a, b, strict=True):
            assert ids_a == ids_b and (logits_a - logits_b).abs().max() <= TOL


@pytest.mark.parametrize("method", SELECTIVE_METHODS)
def test_chunked_prefill_gives_the_same_turns(tiny, method):
    """The recompute row rides with the turn's first chunk; later chunks read the blended view."""
    model, dirs, _ = tiny
    _, whole = run_script(make_engine(model, dirs, method))
    engine = make_engine(model, dirs, method, block_size=4)
    engine.scheduler.config = SchedulerConfig(max_step_tokens=3)
    _, chunked = run_script(engine)
    for a, b in zip(whole, chunked, strict=True):
        assert a.token_ids == b.token_ids and (a.first_logits - b.first_logits).abs().max() <= TOL
        assert b.prefill_tokens == a.prefill_tokens


@pytest.mark.parametrize("method", SELECTIVE_METHODS)
def test_the_first_chunk_plans_the_recompute_each_time_it_is_asked(tiny, method):
    """The scheduler may ask for a step's plans again when the pool had no room: planning has no
    side effect, so the recompute row is planned again, and never with a later chunk."""
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method)
    s = engine.session()
    s.append(list(range(1, 13)))
    s.generate(agent="plan", max_new_tokens=3, temperature=0.0)
    s.append(list(range(30, 36)))
    m, st = s.method, s.state
    m.reuse_prefix(st, "action", s.token_ids)
    m.begin_turn(st, "action")
    t0 = st.turn_start
    asked = [m.plans(st, "action", s.token_ids[t0 : t0 + 2], t0) for _ in range(2)]
    later = m.plans(st, "action", s.token_ids[t0 + 2 :], t0 + 2)
    for plans in asked:
        assert [p.recompute is not None for p in plans] == [False, True]
        assert plans[1].token_ids == s.token_ids[:t0] and plans[1].prefill_cost < t0
    assert [p.recompute for p in later] == [None]
    m.end_turn(st, "action", s.token_ids)


@pytest.mark.parametrize("method", SELECTIVE_METHODS)
def test_a_turn_never_rewrites_the_shared_cache(tiny, method):
    """Recomputed entries land in the agent's view only: a turn leaves the shared cache's entries
    of the tokens before it as they were (each from its author), and drops the view at its end."""
    model, dirs, _ = tiny
    checked = []

    def on_turn(s, agent):
        shared, L = s.state.full["shared"], model.config.num_layers
        t0 = shared.length
        before = [[t.clone() for t in shared.kv(layer, 0, t0)] for layer in range(L)]

        def after(turn):
            assert s.state.turn is None
            for layer in range(L):
                for x, y in zip(before[layer], shared.kv(layer, 0, t0), strict=True):
                    assert torch.equal(x, y)
            checked.append(t0)

        return after

    run_script(make_engine(model, dirs, method), on_turn=on_turn)
    assert checked == [0, 15, 23, 30, 36]  # the tokens before each turn of SCRIPT


def test_recompute_refuses_bad_layers_and_partial_selections():
    with pytest.raises(ValueError, match="not within"):
        Recompute(4, first_write=2, last_layer=1)
    with pytest.raises(ValueError, match="together"):
        Recompute(4, select_layer=1)
    with pytest.raises(ValueError, match="before the last layer"):
        Recompute(4, select_layer=3, select=lambda *a: None, kept=1)
    assert Recompute(4, select_layer=1, select=lambda *a: None, kept=3).token_layers(10) == 10 * 2 + 3 * 2


def test_method_options_are_checked(tiny):
    model, dirs, _ = tiny
    adapters = make_engine(model, dirs, "fullshared").adapters
    with pytest.raises(ValueError, match="rho"):
        make_method("cacheblend", model, adapters, rho=0.0)
    with pytest.raises(ValueError, match="check_layer"):
        make_method("cacheblend", model, adapters, check_layer=2)  # 3 layers: nothing after it
    with pytest.raises(ValueError, match="not within"):
        make_method("droidspeak", model, adapters, layers=(1, 3))
    with pytest.raises(ValueError, match="rho"):
        make_method("relaycaching", model, adapters, rho=1.5)


def test_droidspeak_profile_is_stored_with_the_adapters_and_checked(tiny, tmp_path):
    model, dirs, _ = tiny
    adapters = make_engine(model, dirs, "fullshared").adapters
    prof = profile(model, adapters, n_critical=2)
    errors = prof["layer_errors"]
    assert len(errors) == 3 and all(e > 0 for e in errors)
    first = prof["layers"][0]
    assert prof["layers"] == [first, first + 1]
    assert errors[first] + errors[first + 1] == max(errors[0] + errors[1], errors[1] + errors[2])
    path = save_profile(model, adapters, tmp_path, n_critical=1)
    stored = json.loads(path.read_text())
    assert stored["layers"][0] == stored["layers"][1] == max(range(3), key=stored["layer_errors"].__getitem__)
    assert read_profile(path, model, adapters)["layers"] == stored["layers"]
    single = profile(model, {"plan": adapters["plan"]}, n_critical=1)  # against the base model
    assert single["adapters"] == ["plan"] and sum(single["layer_errors"]) > 0 and single["layers"] is not None
    assert profile(model, {})["layers"] is None  # nothing can deviate: no recompute
    stored["adapters"] = ["plan", "other"]
    path.write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="droidspeak.json profiles"):
        read_profile(path, model, adapters)


def test_registry_builds_the_three(tiny):
    model, dirs, _ = tiny
    adapters = make_engine(model, dirs, "fullshared").adapters
    assert [make_method(m, model, adapters).name for m in SELECTIVE_METHODS] == list(SELECTIVE_METHODS)
