"""The Triton backend against the torch reference, on CPU through Triton's interpreter.

The kernel reads the same pool and the same :class:`BatchMetadata` as the torch backend, so each
case scatters several trajectories over a shuffled pool (prefill continuations, decode rows, rows
that read contiguous pieces, base + LR reads next to plain full-cache reads as ReBaseShared builds
them, adapter-free rows as in ReBaseShared DB) and compares every row's output at every layer,
over ranks 1, 3, 8, 12, GQA groups 1 and 3, head_dim 16 and 64, adapters on q/v or q/k/v/o or
none, with and without flash-decoding splits. Then whole engines: ``attention_backend="triton"``
generates what ``"torch"`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from precache.cache.attention import BatchMetadata, RowAttention, TritonBackend, get_backend
from precache.cache.attention.triton_metadata import refusal
from precache.cache.pool import KVPool, LRView, PagedStore
from precache.cache.rowplan import View
from precache.cache.views import view_reads
from precache.lora.adapter import LoRAAdapter
from precache.models import model_from_hf
from tests.tiny import AGENTS, make_engine, run_script, save_random_adapter, tiny_model

pytest.importorskip("triton")

RANKS = (1, 3, 8, 12)
# Triton reads TRITON_INTERPRET when it is first imported, and the rest of the suite imports it
# (through torch) during collection: the cases run in a child pytest started with the flag set.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the interpreter child of test_cases_in_triton_interpreter"
)


@pytest.mark.skipif(INTERPRETED, reason="the child itself")
def test_cases_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    assert " passed" in child.stdout and " failed" not in child.stdout


def _model(head_dim: int, group: int):
    n_kv = 2
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=n_kv * group * head_dim,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=n_kv * group,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=128,
    )
    return model_from_hf(AutoModelForCausalLM.from_config(cfg))


def _adapter(name, model, rank, targets, g, layers=None):
    c = model.config
    weights = {}
    for layer in layers if layers is not None else range(c.num_layers):
        for proj in targets:
            a = torch.randn(c.hidden_size, rank, generator=g) * 0.3
            weights[(layer, proj)] = (a, torch.randn(rank, c.num_kv_heads * c.head_dim, generator=g) * 0.3)
    return LoRAAdapter(name, rank, 2.0 * rank, 2.0, frozenset(targets), weights)


def _random_batch(model, seed: int, dtype=torch.float32):
    """A pool filled with random values, and one forward's metadata over random rows."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    rank_qv, rank_all = RANKS[seed % 4], RANKS[(seed + 1) % 4]
    adapters = {
        "qv": _adapter("qv", model, rank_qv, ["q_proj", "v_proj"], g),
        "all": _adapter("all", model, rank_all, ["q_proj", "k_proj", "v_proj", "o_proj"], g),
        # k/v LoRA on layer 0 only: the LR columns of layer 1 are never written (NaN here)
        "first": _adapter("first", model, 2, ["k_proj", "v_proj"], g, layers=[0]),
    }
    ranks = {"qv": (0, rank_qv), "all": (rank_all, rank_all), "first": (2, 2)}
    probe = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, ranks, 1 << 30, 4)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, ranks, 96 * probe.block_bytes, 4, dtype)
    for t in (pool.k, pool.v, pool.lr):
        t.copy_(torch.randn(t.shape, generator=g))
    pool.lr[1][:, pool.lr_cols["first"][0].start : pool.lr_cols["first"][1].stop] = float("nan")
    rows, start = [], 0
    for i in range(rnd.randint(3, 6)):
        n = rnd.randint(2, 45)
        store = PagedStore(pool)
        for _ in range(pool.blocks_for(n)):  # scattered blocks: a random free block each time
            store.blocks.append(pool.allocator.allocate(after=rnd.randrange(pool.num_blocks)))
        store.commit(n)
        T = min(n, [1, 1, 2, 4, 7, n][(i + seed) % 6])
        agent = rnd.choice(["qv", "all", "first", None])
        lr = LRView(store, agent, n) if agent else None
        adapter = adapters[agent] if agent else None
        cut = rnd.randint(0, n)
        if rnd.random() < 0.5:  # ReBaseShared: base + LR before the turn, the turn's own full cache after
            turn = PagedStore(pool, offset=cut)
            turn.prepare_write(cut, n)
            turn.commit(n)
            views = [View(store, 0, cut, lr, adapter), View(turn, cut, n)]
        else:
            views = [View(store, 0, cut, lr, adapter), View(store, cut, n, lr, adapter)]
        views = [v for v in views if v.end > v.start]
        reads = tuple(r for v in views for r in view_reads(model, v, split_runs=T <= 4))
        rows.append(RowAttention(slice(start, start + T), n - T, reads))
        start += T
        if (
            agent is not None and rnd.random() < 0.4
        ):  # ReBaseShared DB: the adapter-free row of the same tokens
            reads = tuple(view_reads(model, View(store, 0, n), split_runs=T <= 4))
            rows.append(RowAttention(slice(start, start + T), n - T, reads))
            start += T
    q = torch.randn(start, c.num_heads, c.head_dim, generator=g).to(dtype)
    return q, BatchMetadata(tuple(rows), start), pool


def test_k_lr_on_wide_tiles_refused_on_cuda_only():
    """Tiles of more than 16 query slots that add the k-side LR term faulted on an H200
    (benchmarks/RESULTS.md, "GPU"): on CUDA such a forward runs the torch reference; decode rows,
    q/v adapters and the CPU keep the kernel."""
    model = _model(16, 3)
    c, g = model.config, torch.Generator().manual_seed(0)
    adapters = {
        "all": _adapter("all", model, 4, ["q_proj", "k_proj", "v_proj"], g),
        "qv": _adapter("qv", model, 4, ["q_proj", "v_proj"], g),
    }
    ranks = {"all": (4, 4), "qv": (0, 4)}
    probe = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, ranks, 1 << 30, 4)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, ranks, 32 * probe.block_bytes, 4)

    def meta(agent: str, n_q: int) -> BatchMetadata:
        store = PagedStore(pool)
        for _ in range(pool.blocks_for(40)):
            store.blocks.append(pool.allocator.allocate())
        store.commit(40)
        view = View(store, 0, 40, LRView(store, agent, 40), adapters[agent])
        return BatchMetadata(
            (RowAttention(slice(0, n_q), 40 - n_q, tuple(view_reads(model, view, split_runs=False))),), n_q
        )

    on_cuda = SimpleNamespace(config=c, dtype=model.dtype, device="cuda")
    assert "k-side LR term" in refusal(meta("all", 8), on_cuda)  # 24 query slots: a 64-slot tile
    assert refusal(meta("all", 5), on_cuda) is None  # 15 slots: one 16-slot tile, as a decode row
    assert refusal(meta("qv", 8), on_cuda) is None  # no k_proj LoRA
    assert refusal(meta("all", 8), model) is None  # the CPU interpreter runs it


# (head_dim, GQA group, seed): every rank appears at each shape; head_dim 128 with Llama-3's group of 4
CASES = [(d, g, s) for d in (16, 64) for g in (1, 3) for s in range(4)] + [(128, 4, 0), (128, 1, 3)]


@in_interpreter
@pytest.mark.parametrize(("head_dim", "group", "seed"), CASES)
def test_triton_equals_torch_backend_on_random_rows(head_dim, group, seed):
    model = _model(head_dim, group)
    q, meta, _ = _random_batch(model, seed)
    splits = 1 + seed % 3  # one launch, or flash-decoding splits merged afterwards
    triton = TritonBackend(num_splits=splits, block_n=16)
    triton.prepare(meta, model)  # once: every layer reads the same slot tables
    for layer in range(model.config.num_layers):
        want = get_backend("torch").forward(q, layer, meta, model)
        got = triton.forward(q, layer, meta, model)
        assert got.shape == want.shape
        assert not want.isnan().any()
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (layer, (got - want).abs().max())


@in_interpreter
@pytest.mark.parametrize("window", [(1, None), (5, 12)])
def test_triton_sliding_window_equals_torch_backend(window):
    model = _model(16, 3)
    q, meta, _ = _random_batch(model, 2)
    meta = BatchMetadata(tuple(dataclasses.replace(row, window=window) for row in meta.rows), meta.num_tokens)
    triton = TritonBackend(num_splits=2, block_n=16)
    triton.prepare(meta, model)
    for layer in range(model.config.num_layers):
        want = get_backend("torch").forward(q, layer, meta, model)
        assert torch.allclose(triton.forward(q, layer, meta, model), want, atol=2e-5, rtol=1e-4), layer
    assert not triton.refused


@in_interpreter
def test_triton_bf16_matches_fp32_reference_within_bf16_tolerance():
    model = _model(64, 3)
    q, meta, pool = _random_batch(model, 5, dtype=torch.bfloat16)
    bf16_model = model_from_hf(
        AutoModelForCausalLM.from_config(model.hf_config).to(torch.bfloat16)
    )  # bf16 RoPE tables, as on a GPU
    triton = TritonBackend()
    triton.prepare(meta, bf16_model)
    got = triton.forward(q, 0, meta, bf16_model).float()
    for t in (pool.k, pool.v, pool.lr):  # the same values in fp32
        t.data = t.data.float()
    want = get_backend("torch").forward(q.float(), 0, meta, model)
    assert not torch.allclose(got, want, atol=1e-4)  # bf16 really ran
    assert torch.allclose(got, want, atol=5e-2, rtol=2e-2), (got - want).abs().max()


@in_interpreter
def test_a_row_with_two_adapters_falls_back_to_the_torch_reference(caplog):
    model = _model(16, 1)
    _, _, pool = _random_batch(model, 1)  # ranks: qv (0, 3), all (8, 8)
    g = torch.Generator().manual_seed(9)
    store = PagedStore(pool)
    store.prepare_write(0, 20)
    store.commit(20)
    views = [
        View(store, 0, 12, LRView(store, "qv", 20), _adapter("a", model, 3, ["v_proj"], g)),
        View(store, 12, 20, LRView(store, "all", 20), _adapter("b", model, 8, ["k_proj", "v_proj"], g)),
    ]
    reads = tuple(r for v in views for r in view_reads(model, v, split_runs=False))
    meta = BatchMetadata((RowAttention(slice(0, 3), 17, reads),), 3)
    q = torch.randn(3, model.config.num_heads, model.config.head_dim, generator=g)
    triton = TritonBackend()
    with caplog.at_level(logging.INFO, logger="precache.cache.attention.triton_backend"):
        triton.prepare(meta, model)
    got = triton.forward(q, 0, meta, model)
    assert "a row reads the LR caches of two adapters" in caplog.text
    assert torch.equal(got, get_backend("torch").forward(q, 0, meta, model))


def test_triton_forward_needs_the_metadata_prepared():
    model = _model(16, 1)
    q, meta, _ = _random_batch(model, 0)
    with pytest.raises(ValueError, match=r"prepare\(meta, model\) once per forward"):
        TritonBackend().forward(q, 0, meta, model)


@pytest.fixture(scope="module")
def engine_setup(tmp_path_factory):
    model, hf = tiny_model("llama", seed=3, num_layers=2)
    root = tmp_path_factory.mktemp("triton-adapters")
    targets = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"), ("v_proj",)]
    dirs = {
        a: save_random_adapter(hf, root / a, targets=t, r=r, seed=i + 1)
        for i, (a, t, r) in enumerate(zip(AGENTS, targets, (3, 8, 5), strict=True))
    }
    return model, dirs


@in_interpreter
@pytest.mark.parametrize("method", ["prelrshared", "rebaseshared-db"])
def test_engine_with_triton_backend_generates_what_torch_does(engine_setup, method):
    model, dirs = engine_setup
    runs = {}
    for backend in ("torch", "triton"):
        engine = make_engine(model, dirs, method, attention_backend=backend)
        assert engine.attention.name == backend
        assert not getattr(engine.attention, "refused", None)  # the kernel ran every forward
        session, turns = run_script(engine)
        runs[backend] = (session.token_ids, turns)
    (ids_t, turns_t), (ids_k, turns_k) = runs["torch"], runs["triton"]
    assert ids_k == ids_t
    for a, b in zip(turns_t, turns_k, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(a.first_logits, b.first_logits, atol=1e-4, rtol=1e-4)
