"""The captured decode step (:mod:`precache.models.step_graph`, :mod:`precache.cache.step_inputs`)
against the eager forward, its oracle: at every step the graph runs, the eager forward on the same
pool gives the same logits (fp32: within 1e-4 of the logit scale) and writes the same entries, and
a whole trajectory gives the same greedy tokens, for every sharing method, batched with mixed
adapters, across preemption, ``n`` choices and adapters loaded at run time."""

from __future__ import annotations

import argparse

import pytest
import torch

import precache.cache.plan as plan_module
from precache.cache.pool import KVPool
from precache.cache.step_inputs import _padded
from precache.errors import ModelLoadError
from precache.methods import METHODS
from precache.models.step_attention import VALUE_PAD
from precache.models.step_graph import DecodeGraph
from tests.tiny import AGENTS, make_engine, run_script, save_random_adapter, tiny_hf_model, tiny_model

#: logits of a captured step against the eager forward's, relative to the largest logit
FP32_LOGITS = 1e-4
#: the same for bf16 weights, compute and caches: two bf16 evaluations of the same maths round at
#: different places (inductor keeps fp32 inside its fused kernels, eager rounds after every op);
#: measured on this random tiny model: up to 0.04 for the step's module run eagerly, 0.056 compiled
#: with inductor's emulate_precision_casts (0.15 without)
BF16_LOGITS = 0.1
#: int8 weight-only: both sides run aten._weight_int8pack_mm on the same int8 weights
INT8_LOGITS = 5e-2
#: int4 weight-only: both sides run aten._weight_int4pack_mm_for_cpu on the same codes (bf16 out)
INT4_LOGITS = 5e-2
#: an fp32 model over a bf16 pool: both sides attend to bf16 entries (the graph rounds the row's
#: own new ones as the pool will hold them); an entry whose fp32 values differ in the last bits
#: may round to neighbouring bf16 values
KV_BF16_LOGITS = 1e-3


class Oracle:
    """Wraps the engine's captured step: before each captured step the pool is copied; after it
    the eager forward runs the same rows on the copy, and the logits (relative to the largest) and
    the pool entries (``|a - b| / (1 + |b|)``) are compared."""

    def __init__(self, monkeypatch):
        self.steps, self.logits_err, self.pool_err, self.batch_sizes = 0, 0.0, 0.0, set()
        self.layouts: list[tuple[int, int]] = []  # (rows, runs read in place; 0: gathered) per step
        captured, prepare = plan_module._captured_step, plan_module.decode_step

        def recorded(model, plans, pool):
            step = prepare(model, plans, pool)
            if step is not None:
                self.layouts.append((len(plans), len(step.reads[0]) if step.inputs.window else 0))
            return step

        def checked(model, batch):
            pool = next((w.paged.pool for p in batch for w in p.writes), None)
            before = [t.clone() for t in (pool.k, pool.v, pool.lr)] if pool is not None else None
            got = captured(model, batch)
            if got is None:
                return None
            after = [t.clone() for t in (pool.k, pool.v, pool.lr)]
            for t, b in zip((pool.k, pool.v, pool.lr), before, strict=True):
                t.copy_(b)
            ref = plan_module._eager_forward(
                model, batch, [p.row for p in batch], list(range(len(batch))), None
            )
            got_rows = got[: len(batch)].float()
            scale = ref.float().abs().max().item()
            err = (got_rows - ref.float()).abs().nan_to_num(float("inf")).max().item()  # NaN: no match
            self.logits_err = max(self.logits_err, err / scale)
            for a, t in zip(after, (pool.k, pool.v, pool.lr), strict=True):
                if a.numel():  # relative to the entry where it is large, absolute where it is small
                    err = ((a.float() - t.float()).abs() / (1 + t.float().abs())).nan_to_num(float("inf"))
                    err = torch.where((a == t) | (a.isnan() & t.isnan()), 0.0, err)  # as never written
                    self.pool_err = max(self.pool_err, err.max().item())
                t.copy_(a)
            self.steps += 1
            self.batch_sizes.add(len(batch))
            return got

        monkeypatch.setattr(plan_module, "_captured_step", checked)
        monkeypatch.setattr(plan_module, "decode_step", recorded)


@pytest.fixture(scope="module")
def graph_model(tiny):
    """The ``tiny`` fixture's weights (same seed) in a second model that runs the compiled step."""
    model, _ = tiny_model("llama", seed=0, num_layers=3)
    model.compile()
    return model


def test_a_compile_is_logged_before_and_after_it(tiny, caplog):
    """Where stderr is no terminal the progress bar is not drawn: the log says that the step is
    being compiled before the (minutes-long, when cold) wait, and how long it took after it; a
    step whose graph is held compiles nothing and logs nothing."""
    _, dirs, _ = tiny
    model, _ = tiny_model("llama", seed=0, num_layers=3)
    model.compile()
    engine = make_engine(model, dirs, "prelrshared")
    session = engine.session()
    session.append(list(range(3, 40)))
    with caplog.at_level("INFO", logger="precache.models.step_graph"):
        session.generate(agent=AGENTS[0], max_new_tokens=4, temperature=0.0)
    messages = [r.getMessage() for r in caplog.records if r.name == "precache.models.step_graph"]
    assert messages[0].startswith("compiling the decode step for 1 row")
    assert messages[1].startswith("decode step for 1 row") and " compiled in " in messages[1]
    caplog.clear()
    with caplog.at_level("INFO", logger="precache.models.step_graph"):
        session.generate(agent=AGENTS[0], max_new_tokens=4, temperature=0.0)
    assert not [r for r in caplog.records if r.name == "precache.models.step_graph"]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_decodes_through_the_graph_as_the_eager_forward(tiny, graph_model, monkeypatch, method):
    eager, dirs, _ = tiny
    oracle = Oracle(monkeypatch)
    _, turns = run_script(make_engine(graph_model, dirs, method))
    monkeypatch.undo()
    _, ref_turns = run_script(make_engine(eager, dirs, method))
    assert oracle.steps >= 10  # every decode step of the script ran captured
    assert oracle.logits_err <= FP32_LOGITS
    assert oracle.pool_err <= 1e-4
    assert [t.token_ids for t in turns] == [t.token_ids for t in ref_turns]


@pytest.mark.parametrize("method", ["nonshared", "prelrshared"])
def test_one_run_of_keys_is_read_in_place_and_a_scattered_row_gathered(
    tiny, graph_model, monkeypatch, method
):
    """A lone row whose other keys are one run of pool rows reads the pool's views in place (the
    window layout); a second trajectory that shares the first one's prompt prefix (cached blocks)
    and continues in blocks of its own reads two runs in place, except at its first step, when its
    own blocks hold one key before the row's own (a run of one row: gathered): all as the eager
    forward. The agent's LR columns are not the pool's first, so a window that reads another
    agent's columns (or counts them from the wrong first column) shows in the logits."""
    eager, dirs, _ = tiny
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 90, (48,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 90, (n,), generator=gen).tolist() for n in (5, 1)]

    def turns(engine):
        out = []
        for prompt in prompts:
            session = engine.session()
            session.append(prompt)
            out.append(session.generate(agent=AGENTS[1], max_new_tokens=12, temperature=0.0).token_ids)
        return out

    oracle = Oracle(monkeypatch)
    got = turns(make_engine(graph_model, dirs, method))
    monkeypatch.undo()
    assert got == turns(make_engine(eager, dirs, method))
    assert {runs for rows, runs in oracle.layouts if rows == 1} == {0, 1, 2}
    assert oracle.logits_err <= FP32_LOGITS and oracle.pool_err <= 1e-4


def _batched(engine, prompts, lengths):
    requests = []
    for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
        s = engine.session()
        s.append(prompt)
        params = {"max_new_tokens": length, "temperature": 0.0, "ignore_eos": True}
        requests.append(s.submit(AGENTS[i % 3], **params))
    engine.wait_all(requests)
    return [r.outcome().token_ids for r in requests]


@pytest.mark.parametrize("method", ["prelrshared", "nonshared", "rebaseshared-db", "rebaseownshared-lp"])
def test_batched_mixed_adapters_changing_buckets_and_preemption(tiny, graph_model, monkeypatch, method):
    """Five trajectories of different lengths, three adapters, stopping at different steps (the
    batch size changes), in a pool that forces swaps mid-decode (tests/test_preemption.py's)."""
    eager, dirs, _ = tiny
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 90, (30 + 7 * i,), generator=gen).tolist() for i in range(5)]
    lengths = [24] * 5  # the preemption swaps one out: it finishes after the others
    block = make_engine(eager, dirs, method).pool.block_bytes
    options = {"prefix_caching": False, "kv_cache_bytes": 14 * block}
    oracle = Oracle(monkeypatch)
    graph_engine = make_engine(graph_model, dirs, method, **options)
    got = _batched(graph_engine, prompts, lengths)
    monkeypatch.undo()
    ref = _batched(make_engine(eager, dirs, method, **options), prompts, lengths)
    assert got == ref
    assert graph_engine.scheduler.preemptions > 0
    assert len(oracle.batch_sizes) >= 2 and max(oracle.batch_sizes) >= 2
    assert oracle.logits_err <= FP32_LOGITS and oracle.pool_err <= 1e-4


def test_n_choices_fork_and_decode_through_the_graph(tiny, graph_model, monkeypatch):
    eager, dirs, _ = tiny
    prompt = torch.randint(3, 90, (20,), generator=torch.Generator().manual_seed(9)).tolist()

    def choices(model):
        s = make_engine(model, dirs, "prelrshared").session()
        s.append(prompt)
        return [
            t.token_ids for t in s.generate_choices("plan", n=3, max_new_tokens=6, temperature=0.9, seed=3)
        ]

    oracle = Oracle(monkeypatch)
    got = choices(graph_model)
    monkeypatch.undo()
    assert got == choices(eager)
    assert oracle.steps > 0 and 3 in oracle.batch_sizes
    assert oracle.logits_err <= FP32_LOGITS


def test_an_adapter_loaded_at_run_time_decodes_through_the_graph(tiny, graph_model, monkeypatch, tmp_path):
    eager, dirs, _ = tiny
    _, hf = tiny_model("llama", seed=0, num_layers=3)
    late = save_random_adapter(hf, tmp_path / "critic", targets=("q_proj", "v_proj"), r=4, seed=11)

    def run(model):
        engine = make_engine(model, dirs, "prelrshared", max_adapters=4)
        s = engine.session()
        s.append(list(range(5, 30)))
        first = s.generate("plan", max_new_tokens=4, temperature=0.0).token_ids
        engine.add_adapter("critic", late)
        s.append(list(range(40, 46)))
        return first, s.generate("critic", max_new_tokens=5, temperature=0.0).token_ids

    oracle = Oracle(monkeypatch)
    got = run(graph_model)
    monkeypatch.undo()
    assert got == run(eager)
    assert oracle.steps >= 7 and oracle.logits_err <= FP32_LOGITS


@pytest.mark.parametrize(
    "kind,targets",
    [
        ("qwen2", ("q_proj", "k_proj", "v_proj")),  # q/k/v biases
        ("qwen3", ("q_proj", "v_proj", "o_proj", "down_proj")),  # q/k norms (no k LoRA: split key)
        ("llama", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ],
)
@pytest.mark.parametrize(
    "method", ["nonshared", "prelrshared", "rebaseshared-db", "rebaseownshared-lp", "cacheblend"]
)
def test_the_traced_step_covers_families_and_every_projection(monkeypatch, tmp_path, kind, targets, method):
    """The step's maths (the module inductor compiles, run eagerly: ``compiled=False``) for model
    families with biases and q/k norms, and adapters on every projection."""
    model, hf = tiny_model(kind, seed=2)
    dirs = {
        a: save_random_adapter(hf, tmp_path / a, targets=targets, r=4, seed=i + 1)
        for i, a in enumerate(AGENTS)
    }
    ref_model, _ = tiny_model(kind, seed=2)
    model.decode_graph = DecodeGraph(model, compiled=False)
    oracle = Oracle(monkeypatch)
    _, turns = run_script(make_engine(model, dirs, method))
    monkeypatch.undo()
    _, ref = run_script(make_engine(ref_model, dirs, method))
    assert oracle.steps >= 10 and oracle.logits_err <= 1e-5
    assert [t.token_ids for t in turns] == [t.token_ids for t in ref]


@pytest.mark.parametrize("precision", ["bfloat16", "int8", "int4", "kv-bfloat16"])
def test_lower_precisions_within_their_tolerance(tiny, monkeypatch, precision):
    _, dirs, _ = tiny
    model, _ = tiny_model("llama", seed=0, num_layers=3)
    options = {}
    if precision == "kv-bfloat16":  # fp32 model, bf16 pool: both sides read the same entries
        options, tolerance = {"kv_cache_dtype": "bfloat16"}, KV_BF16_LOGITS
    elif precision == "int8":
        model.quantize("int8")
        tolerance = INT8_LOGITS
    elif precision == "int4":
        model.quantize("int4")
        tolerance = INT4_LOGITS
    else:
        hf = tiny_hf_model("llama", seed=0, num_layers=3).to(torch.bfloat16)
        from precache.models import model_from_hf

        model = model_from_hf(hf)
        tolerance = BF16_LOGITS
    model.compile()
    oracle = Oracle(monkeypatch)
    run_script(make_engine(model, dirs, "prelrshared", **options))
    assert oracle.steps >= 10
    assert oracle.logits_err <= tolerance, oracle.logits_err


def test_compile_is_the_cpu_default_and_refused_elsewhere(tmp_path, monkeypatch):
    import precache

    tiny_hf_model("llama", seed=0, num_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="runs on the CPU only, not on cuda"):
        precache.load_model(tmp_path, device="cuda", compile=True, require_tokenizer=False)
    monkeypatch.delenv("PRECACHE_EAGER", raising=False)
    assert isinstance(precache.load_model(tmp_path, require_tokenizer=False).decode_graph, DecodeGraph)
    assert precache.load_model(tmp_path, compile=False, require_tokenizer=False).decode_graph is None
    monkeypatch.setenv("PRECACHE_EAGER", "1")
    assert precache.load_model(tmp_path, require_tokenizer=False).decode_graph is None


def test_every_model_command_takes_eager(capsys):
    from precache.cli import main
    from precache.cli_args import add_dtype_argument, model_options

    commands = (
        ["serve"],
        ["bench", "trace"],
        ["bench", "decode"],
        ["bench", "soak"],
        ["eval"],
        ["fidelity"],
        ["run"],
    )
    for command in commands:
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        assert "--eager" in capsys.readouterr().out, command
    parser = argparse.ArgumentParser()
    add_dtype_argument(parser)
    assert model_options(parser.parse_args(["--eager"]))["compile"] is False
    assert model_options(parser.parse_args([]))["compile"] is None


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_compile_decode_step_compiles_every_layout_before_any_request(tiny, prefix_caching):
    """Without prefix caching too (``bench trace`` runs so; there ReBaseOwnShared-LP's first
    gathered step on paper_L1024 compiled inside a timed repeat, 3 minutes cold)."""
    _, dirs, _ = tiny
    model, _ = tiny_model("llama", seed=0, num_layers=3)
    model.compile()
    engine = make_engine(model, dirs, "prelrshared", prefix_caching=prefix_caching)
    engine.compile_decode_step()
    # (rows, runs of the pool read in place): one row in one run, in two runs, in three
    # (gathered), any larger batch gathered
    assert {v[:2] for v in model.decode_graph._variants} == {(1, 1), (1, 2), (1, 0), (2, 0)}
    assert engine.cache_usage()["allocated"] == 0  # the throwaway sessions and spacers left nothing


def test_compile_decode_step_covers_rebaseownshared_steps_with_and_without_lr_columns(tmp_path):
    """ReBaseOwnShared reads LR columns only over another agent's segments (another graph): after
    ``compile_decode_step`` a turn-taking trajectory of every agent traces no graph. The adapters
    share one rank (a step's largest rank is part of its graph)."""
    model, hf = tiny_model("llama", seed=0, num_layers=3)
    dirs = {a: save_random_adapter(hf, tmp_path / a, r=4, seed=i + 1) for i, a in enumerate(AGENTS)}
    model.compile()
    engine = make_engine(model, dirs, "rebaseownshared-lp", prefix_caching=False)
    engine.compile_decode_step()
    compiled = set(model.decode_graph._variants)
    assert {v[3] > 0 for v in compiled if v[0] == 1} == {True, False}  # LR columns read and not
    run_script(engine)
    assert set(model.decode_graph._variants) == compiled


def test_a_context_past_4096_keys_decodes_in_the_same_graph(tmp_path, monkeypatch):
    """inductor's C++ code for a float sum over more than 4,096 elements is another kernel, chosen
    behind a guard on the key count: a softmax summed that way recompiled the step (1.5-3 minutes
    on SmolLM2, inside a serving run) once a trajectory passed 4,096 keys."""
    from torch._dynamo.utils import counters

    model, hf = tiny_model("llama", seed=0, num_layers=2, max_position_embeddings=4400)
    dirs = {a: save_random_adapter(hf, tmp_path / a, r=4, seed=i + 1) for i, a in enumerate(AGENTS[:2])}
    model.compile()
    session = make_engine(model, dirs, "prelrshared").session()
    gen = torch.Generator().manual_seed(3)
    session.append(torch.randint(3, 90, (40,), generator=gen).tolist())
    session.generate(agent=AGENTS[0], max_new_tokens=2, temperature=0.0)
    graphs = counters["stats"]["unique_graphs"]
    oracle = Oracle(monkeypatch)
    session.append(torch.randint(3, 90, (4200,), generator=gen).tolist())
    session.generate(agent=AGENTS[1], max_new_tokens=3, temperature=0.0)
    assert len(session.token_ids) > 4096 + 40
    assert counters["stats"]["unique_graphs"] == graphs  # no graph traced past 4,096 keys
    assert oracle.steps == 2 and oracle.logits_err <= FP32_LOGITS and oracle.pool_err <= 1e-4


def test_trajectories_elsewhere_in_the_pool_decode_in_the_graphs_compiled_at_start(tiny, monkeypatch):
    """Once ``compile_decode_step`` compiled every layout, trajectories whose keys lie at other
    places of the pool and other lengths trace no graph: with duck sizing on, a first
    trajectory's window run starting at an offset equal to the pool's layer stride became a
    guard, and the next trajectory recompiled the step (minutes on SmolLM2) while serving."""
    from torch._dynamo.utils import counters

    _, dirs, _ = tiny
    model, _ = tiny_model("llama", seed=0, num_layers=3)
    model.compile()
    engine = make_engine(model, dirs, "prelrshared")
    engine.compile_decode_step()
    graphs = counters["stats"]["unique_graphs"]
    oracle = Oracle(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    for i, n in enumerate((7, 33, 18, 64, 3, 41)):
        session = engine.session()
        session.append(torch.randint(3, 90, (n,), generator=gen).tolist())
        session.generate(agent=AGENTS[i % 2], max_new_tokens=3, temperature=0.0)
    assert counters["stats"]["unique_graphs"] == graphs
    assert oracle.steps >= 12 and oracle.logits_err <= FP32_LOGITS and oracle.pool_err <= 1e-4


def test_the_rows_read_past_a_run_of_values_are_zeroed_whatever_they_hold(tiny, graph_model, monkeypatch):
    """The window layout reads :data:`VALUE_PAD` rows past each run of values (then zeroes them):
    with every row of the pool's value storage that no step wrote holding NaN (the rows after the
    trajectory's blocks and the spare rows past the last layer), the graph's logits and writes stay
    the eager forward's and the greedy turns those of an eager engine."""
    _, dirs, _ = tiny
    engine = make_engine(graph_model, dirs, "prelrshared")
    v = engine.pool.v
    storage = torch.empty(0, dtype=v.dtype).set_(v.untyped_storage())
    assert storage.numel() >= (v.storage_offset() + v.numel() + VALUE_PAD * v.shape[2] * v.shape[3])
    storage.fill_(float("nan"))
    oracle = Oracle(monkeypatch)
    _, turns = run_script(engine)
    monkeypatch.undo()
    _, want = run_script(make_engine(tiny[0], dirs, "prelrshared"))
    assert [t.token_ids for t in turns] == [t.token_ids for t in want]
    assert any(runs for _, runs in oracle.layouts)  # the window layout ran
    assert oracle.steps >= 10 and oracle.logits_err <= FP32_LOGITS and oracle.pool_err <= 1e-4


def test_a_run_of_values_ending_at_the_pools_last_row_reads_its_spare_rows():
    """``_padded`` views a run and the :data:`VALUE_PAD` rows after it; for a run ending at the last
    row of the last layer those are the pool's spare rows (a view past its storage would raise)."""
    pool = KVPool(
        num_layers=2, num_kv_heads=3, head_dim=8, lr_ranks={}, kv_cache_bytes=4 * 16 * 2 * 2 * 24 * 4
    )
    pool.v.copy_(torch.randn(pool.v.shape))
    n = pool.v.shape[1]
    padded = _padded(pool.v, slice(n - 5, n))
    assert padded.shape == (2, 5 + VALUE_PAD, 3, 8)
    assert torch.equal(padded[:, :5], pool.v[:, n - 5 :])
    assert torch.equal(padded[0, 5 : 5 + n], pool.v[1])  # the next layer's rows


def test_fp32_products_split_over_the_threads_as_the_eager_forward(tiny, monkeypatch):
    """With two threads at compile time the graph's fp32 products run as one batched product over
    two slices of each weight (``split_product``, the eager ``linear``'s CPU path: MKL ran a
    few-row product on one thread); the logits stay the eager forward's."""
    _, dirs, _ = tiny
    model, _ = tiny_model("llama", seed=0, num_layers=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model.compile()
    finally:
        torch.set_num_threads(threads)
    assert model.decode_graph.module.w.parts == 2
    oracle = Oracle(monkeypatch)
    run_script(make_engine(model, dirs, "prelrshared"))
    assert oracle.steps >= 10 and oracle.logits_err <= FP32_LOGITS and oracle.pool_err <= 1e-4
