"""The batch attention backend against plain materialised attention, over random block layouts.

Each case scatters several trajectories' caches over a shuffled pool, builds one forward's
metadata (decode rows read contiguous pieces in place, prefill rows gather), and compares every
row's output with ``softmax(q K^T / sqrt(D)) V`` over fully materialised ``K = Kb + RoPE(s Lk B^k)``,
``V = Vb + s Lv B^v`` (DESIGN.md, Notation), for adapters on k and v, v only, or none.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from precache.cache.attention import BatchMetadata, RowAttention, TorchBackend, decode_batch, get_backend
from precache.cache.attention.triton_metadata import _adapter_stacks
from precache.cache.plan import run_plans
from precache.cache.pool import KVPool, LRView, PagedStore
from precache.cache.rowplan import FullWrite, Recompute, RowPlan, View
from precache.cache.views import view_reads
from precache.lora.adapter import LoRAAdapter
from tests.tiny import tiny_model


def _adapter(name, model, rank, targets, g):
    c = model.config
    w = {}
    for layer in range(c.num_layers):
        for proj in targets:
            a = torch.randn(c.hidden_size, rank, generator=g) * 0.3
            w[(layer, proj)] = (a, torch.randn(rank, c.num_kv_heads * c.head_dim, generator=g) * 0.3)
    return LoRAAdapter(name, rank, 2.0 * rank, 2.0, frozenset(targets), w)


def _reference(model, q, q_start, views, layer, window=None):
    """Materialise every view's K and V position by position, then a plain masked softmax (with a
    sliding ``window``: key ``p`` visible to query ``t`` when ``t - window < p <= t``)."""
    keys, values, pos = [], [], []
    for view in views:
        k, v = view.store.kv(layer, view.start, view.end)
        k, v = k.clone(), v.clone()
        ad = view.adapter
        if view.lr is not None and ad is not None:
            lk, lv = view.lr.lr(layer, view.start, view.end)
            if ad.has(layer, "k_proj"):
                cos, sin = model.rope.tables(torch.arange(view.start, view.end))
                k += model.rope.apply(ad.up(lk, layer, "k_proj").view(k.shape), cos, sin)
            if ad.has(layer, "v_proj"):
                v += ad.up(lv, layer, "v_proj").view(v.shape)
        keys.append(k)
        values.append(v)
        pos.append(torch.arange(view.start, view.end))
    k, v, pos = torch.cat(keys), torch.cat(values), torch.cat(pos)
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    scores = torch.einsum("thd,nhd->htn", q, k) / math.sqrt(D)
    q_pos = (q_start + torch.arange(T))[:, None]
    mask = pos[None, :] <= q_pos
    if window is not None:
        mask &= pos[None, :] > q_pos - window
    probs = torch.softmax(scores.masked_fill(~mask, -torch.inf), -1)
    return torch.einsum("htn,nhd->thd", probs, v).reshape(T, -1)


def _random_pool(model, g, num_blocks):
    """Agents ``kv`` (k and v LoRA, rank 3) and ``v`` (v only, rank 5), and a pool of ``num_blocks``
    blocks of 4 filled with random K, V and LR rows."""
    c = model.config
    adapters = {
        "kv": _adapter("kv", model, 3, ["k_proj", "v_proj"], g),
        "v": _adapter("v", model, 5, ["v_proj"], g),
    }
    ranks = {"kv": (3, 3), "v": (0, 5)}
    probe = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, ranks, 1 << 30, 4)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, ranks, num_blocks * probe.block_bytes, 4)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    pool.lr.normal_(generator=g)
    return adapters, pool


def _scattered_store(pool, n, rnd):
    """A store of ``n`` tokens over scattered blocks: a random free block each time."""
    store = PagedStore(pool)
    for _ in range(pool.blocks_for(n)):
        store.blocks.append(pool.allocator.allocate(after=rnd.randrange(pool.num_blocks)))
    store.commit(n)
    return store


def _random_views(store, n, adapters, rnd):
    """``store`` read by a random agent (or none) as two views cut at a random position, the second
    with or without the agent's LR part; empty views dropped."""
    agent = rnd.choice(["kv", "v", None])
    lr = LRView(store, agent, n) if agent else None
    ad = adapters[agent] if agent else None
    cut = rnd.randint(0, n)
    views = [View(store, 0, cut, lr, ad), View(store, cut, n, lr if rnd.random() < 0.5 else None, ad)]
    return [v for v in views if v.end > v.start]


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_torch_backend_equals_materialised_attention_on_random_rows(seed, windowed):
    """With ``windowed``, layer 1 slides over a random window (layer 0 attends fully), as a Qwen2
    checkpoint with ``max_window_layers = 1``: reads wholly outside the window are skipped."""
    model, _ = tiny_model(num_layers=2)
    c = model.config
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    adapters, pool = _random_pool(model, g, 64)
    windows = (None, rnd.randint(1, 12)) if windowed else None
    rows, reference_rows, start = [], [], 0
    for _ in range(rnd.randint(1, 5)):
        n = rnd.randint(2, 40)
        store = _scattered_store(pool, n, rnd)
        T = rnd.choice([1, 2, 4, 5, n]) if n > 1 else 1
        T = min(T, n)
        views = _random_views(store, n, adapters, rnd)
        reads = tuple(r for v in views for r in view_reads(model, v, split_runs=T <= 4))
        rows.append(RowAttention(slice(start, start + T), n - T, reads, windows))
        reference_rows.append((n - T, views))
        start += T
    q = torch.randn(start, c.num_heads, c.head_dim, generator=g)
    meta = BatchMetadata(tuple(rows), start)
    backend = get_backend("torch")
    backend.prepare(meta, model)
    for layer in range(c.num_layers):
        out = backend.forward(q, layer, meta, model)
        for row, (q_start, views) in zip(rows, reference_rows, strict=True):
            want = _reference(model, q[row.q_rows], q_start, views, layer, row.window_at(layer))
            assert torch.allclose(out[row.q_rows], want, atol=1e-4), (seed, layer, row)


@pytest.mark.parametrize("seed", range(4))
def test_batched_decode_rows_equal_materialised_attention(seed, monkeypatch):
    """Many one-query rows of mixed lengths (agents with k and v LoRA, v only, none; a row's views
    split between LR and no LR; scattered blocks) run as padded decode buckets, and every row
    still equals the materialised reference; the per-row path agrees too."""
    model, _ = tiny_model(num_layers=2)
    c = model.config
    g = torch.Generator().manual_seed(100 + seed)
    rnd = random.Random(seed)
    adapters, pool = _random_pool(model, g, 200)
    del adapters["kv"].weights[(1, "k_proj")]  # layer 1: v only for "kv"
    rows, reference_rows = [], []
    for b in range(rnd.randint(6, 12)):
        n = rnd.choice([rnd.randint(1, 12), rnd.randint(30, 40)])  # two length classes: two buckets
        store = _scattered_store(pool, n, rnd)
        views = _random_views(store, n, adapters, rnd)
        reads = tuple(r for v in views for r in view_reads(model, v, split_runs=rnd.random() < 0.5))
        rows.append(RowAttention(slice(b, b + 1), n - 1, reads))
        reference_rows.append((n - 1, views))
    q = torch.randn(len(rows), c.num_heads, c.head_dim, generator=g)
    outs = []
    if seed == 3:  # rows past the key cap keep the per-row path
        monkeypatch.setattr(decode_batch, "BATCH_MAX_KEYS", 20)
        monkeypatch.setattr(decode_batch, "BATCH_MAX_KEYS_ONE_THREAD", 20)
    for batch_decode in (True, False):
        meta = BatchMetadata(tuple(rows), len(rows))
        backend = TorchBackend(batch_decode=batch_decode)
        backend.prepare(meta, model)
        batched = sum(bucket.q_rows.shape[0] for bucket in meta.prepared.buckets)
        assert batched >= (2 if batch_decode else 0) and (batch_decode or batched == 0)
        assert all(bucket.slots.shape[1] <= decode_batch.batch_max_keys() for bucket in meta.prepared.buckets)
        outs.append([backend.forward(q, layer, meta, model) for layer in range(c.num_layers)])
    for layer in range(c.num_layers):
        for row, (q_start, views) in zip(rows, reference_rows, strict=True):
            want = _reference(model, q[row.q_rows], q_start, views, layer)
            for out in outs:
                assert torch.allclose(out[layer][row.q_rows], want, atol=1e-4), (seed, layer, row)


def test_unknown_backend_names_the_ones_there_are():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch"):
        get_backend("flash")


class _Spy(TorchBackend):
    """The torch reference, recording what it prepared and which metadata each layer read."""

    def __init__(self):
        self.prepared, self.layers = [], []

    def prepare(self, meta, model):
        meta.prepared = len(self.prepared)
        self.prepared.append(meta.num_tokens)

    def forward(self, q, layer, meta, model):
        self.layers.append((layer, meta.prepared, meta.num_tokens))
        return super().forward(q, layer, meta, model)


def test_run_plans_prepares_the_metadata_once_and_every_layer_reads_it():
    """One prepare per metadata: at the start of the forward and after a recompute row narrows
    the batch (not after the last layer, which no layer reads); every layer reads the metadata of
    the batch it runs, and the logits equal the plain torch reference's."""
    model, _ = tiny_model(num_layers=3)
    c = model.config
    logits = []
    for backend in (_Spy(), TorchBackend()):
        pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, {}, 1 << 22, 4)
        store = PagedStore(pool)
        run_plans(model, [RowPlan(list(range(3, 13)), 0, None, [FullWrite(store)], [View(store, 0, 10)])])
        keep_two = Recompute(
            c.num_layers, select_layer=0, select=lambda x, rows, pos: torch.tensor([1, 4]), kept=2
        )
        recompute = RowPlan(
            list(range(3, 13)), 0, None, [FullWrite(store)], [View(store, 0, 10)], False, keep_two
        )
        decode = RowPlan([13], 10, None, [FullWrite(store)], [View(store, 0, 11)])
        logits.append(run_plans(model, [recompute, decode], backend)[1])
        if isinstance(backend, _Spy):
            spy = backend
    assert spy.prepared == [11, 3]  # 1 decode token + 10 recomputed, then 1 + the 2 kept
    assert spy.layers == [(0, 0, 11), (1, 1, 3), (2, 1, 3)]
    assert torch.equal(logits[0], logits[1])


def test_adapter_stacks_put_each_layers_scaled_b_at_its_layer():
    """Layers without a LoRA on the projection stay zero, wherever the adapter's layers sit
    (contiguous or not); ``rot`` is RoPE's rotate-half of ``s B^k`` on each head's columns."""
    model, _ = tiny_model(num_layers=4)
    c = model.config
    g = torch.Generator().manual_seed(0)
    adapters = [_adapter("a", model, 3, ["k_proj", "v_proj"], g), _adapter("b", model, 2, ["v_proj"], g)]
    for layer in (1, 2):  # "a": k_proj at layers 0 and 3 only, v_proj at 0, 3 and 1
        del adapters[0].weights[(layer, "k_proj")]
    del adapters[0].weights[(2, "v_proj")]
    bk, bkrot, bv = _adapter_stacks(adapters, model, 16)
    assert bk.shape == (c.num_layers, 2, c.num_kv_heads, 16, c.head_dim)
    half = c.head_dim // 2
    for i, adapter in enumerate(adapters):
        for layer in range(c.num_layers):
            for proj, stack in (("k_proj", bk), ("v_proj", bv)):
                want = torch.zeros(c.num_kv_heads, 16, c.head_dim)
                if adapter.has(layer, proj):
                    b = adapter.weights[(layer, proj)][1] * adapter.scaling  # [r, Hkv * D]
                    want[:, : b.shape[0]] = b.view(b.shape[0], c.num_kv_heads, c.head_dim).transpose(0, 1)
                assert torch.equal(stack[layer, i], want), (adapter.name, layer, proj)
            k = bk[layer, i]
            assert torch.equal(bkrot[layer, i], torch.cat((-k[..., half:], k[..., :half]), dim=-1))
