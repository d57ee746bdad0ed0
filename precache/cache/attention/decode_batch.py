"""Decode rows of one forward attended as one padded batch (the torch backend's decode path).

A decode step of ``B`` trajectories otherwise runs ``B`` small attention calls per layer, each a
dozen torch ops: at batch 16 on a CPU that loop, not the arithmetic, was the largest part of a
step (PreLRShared, 16 rows of 256 keys: 71.9 ms of a 152.5 ms step, the weight products 62.4;
2-core AMD EPYC, measured 2026-12-01 in an earlier run, in benchmarks/RESULTS.md's git history).
Here the rows' key slots are gathered once per forward into a padded ``[B, L]`` table of pool
rows; each layer then gathers ``Kb``/``Vb`` through it and runs one batched score product, one
softmax and one value product for all rows. Each agent's LR part is one group of slots:
``RoPE(s Lk B^k)`` added to those keys, and ``s (P Lv) B^v`` added to the output for the rows
that read it (DESIGN.md, Notation), so the values stay base + low rank as in
:func:`~precache.cache.attention.segments.attend`, which stays the reference the tests compare to.

Rows are bucketed by length so that padding stays below :data:`PAD_SLACK` of the real slots;
a bucket of one row, rows of several queries, rows under a sliding window, rows reading more
than one pool and rows reading more keys than :func:`batch_max_keys` run through the per-row path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from precache.cache.attention.base import KVRead, RowAttention

#: a bucket's padded slots stay within this factor of its real slots
PAD_SLACK = 1.25
#: rows reading more keys keep the per-row path: the gather copies every key once more per layer,
#: and past about this many keys that costs what batching saves (SmolLM2, 16 rows, 2 threads:
#: batched 35 against 187 ms at 256 keys, 138 against 163 at 1,024, 360 against 393 at 2,048,
#: even at 3,072; ``benchmarks/decode_attention_micro.py``; benchmarks/RESULTS.md, "The eager
#: decode attention: batched buckets")
BATCH_MAX_KEYS = 2048
#: the same at one torch thread, where the per-row products pay no thread start-up (batched 47
#: against 55 ms at 384 keys, 80-122 against 68-111 at 512, three runs each)
BATCH_MAX_KEYS_ONE_THREAD = 384


def batch_max_keys() -> int:
    """The most keys a row may read and still join a decode bucket, at the current torch threads."""
    return BATCH_MAX_KEYS if torch.get_num_threads() > 1 else BATCH_MAX_KEYS_ONE_THREAD


@dataclass(frozen=True)
class _LRGroup:
    """The slots of one bucket that read ``adapter``'s LR columns ``cols`` (``(k cols, v cols)``).

    ``row_of``/``col_of`` ``[n]``: the slots' bucket rows and key columns; ``pool_rows`` ``[n]``:
    their pool rows; ``rows``: the bucket rows holding any of them, and ``local`` ``[n]``: each slot's
    index into the flattened ``[len(rows) * L]`` table of those rows; ``cos``/``sin``
    ``[n, head_dim]``: RoPE tables of the slots' positions (None when the adapter has no k_proj
    LoRA)."""

    adapter: object
    cols: tuple[slice, slice]
    row_of: torch.Tensor
    col_of: torch.Tensor
    pool_rows: torch.Tensor
    rows: torch.Tensor
    local: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


@dataclass(frozen=True)
class DecodeBucket:
    """``B`` one-query rows attended together: ``q_rows`` ``[B]`` (their batch rows), ``slots``
    ``[B, L]`` pool rows (padding reads row 0), ``head_slots`` ``[B * Hkv * L]`` the rows of the pool
    seen as ``[rows * Hkv, head_dim]`` in ``[B, Hkv, L]`` order, ``pad`` ``[B, 1, 1, L]`` True at
    padding slots."""

    pool: object
    q_rows: torch.Tensor
    slots: torch.Tensor
    head_slots: torch.Tensor
    pad: torch.Tensor
    groups: tuple[_LRGroup, ...]
    #: the gathered keys and values, allocated at the first layer and reused by the others
    buffers: list[torch.Tensor] = field(default_factory=list, repr=False)

    def attend(self, q: torch.Tensor, layer: int, model) -> torch.Tensor:
        """``[B, n_heads * head_dim]`` attention output of the bucket's rows at ``layer``
        (``q``: the forward's queries ``[N, n_heads, head_dim]`` after RoPE)."""
        pool = self.pool
        B, L = self.slots.shape
        _, Hq, D = q.shape
        Hkv = pool.k.shape[-2]
        G = Hq // Hkv
        # one gather per cache straight into [B, Hkv, L, D]: the products then run on contiguous
        # batches (a permuted gather made the score product ten times slower on the CPU), into
        # buffers reused by every layer (a fresh one per layer page-faults on the CPU)
        if not self.buffers:
            self.buffers.extend(pool.k.new_empty(2, B * Hkv * L, D).unbind(0))
        k_buf, v_buf = self.buffers
        k = torch.index_select(pool.k[layer].view(-1, D), 0, self.head_slots, out=k_buf).view(B, Hkv, L, D)
        v = torch.index_select(pool.v[layer].view(-1, D), 0, self.head_slots, out=v_buf).view(B, Hkv, L, D)
        k, v = k.to(q.dtype), v.to(q.dtype)  # a pool of another kv_cache_dtype: widened once here
        lr_values = []
        for g in self.groups:
            adapter, has_k, has_v = g.adapter, g.adapter.has(layer, "k_proj"), g.adapter.has(layer, "v_proj")
            if not (has_k or has_v):
                continue
            lr = pool.lr[layer].index_select(0, g.pool_rows).to(q.dtype)  # [n, C]
            if has_k:
                delta = adapter.up(lr[:, g.cols[0]], layer, "k_proj").view(-1, Hkv, D)
                k[g.row_of, :, g.col_of] += model.rope.apply(delta, g.cos, g.sin)
            if has_v:
                lv = lr[:, g.cols[1]]
                table = lv.new_zeros(g.rows.shape[0] * L, lv.shape[1])
                table[g.local] = lv
                lr_values.append((g, table.view(-1, L, lv.shape[1])))
        qh = (q[self.q_rows] * (1.0 / math.sqrt(D))).view(B, Hkv, G, D)
        scores = torch.matmul(qh, k.transpose(-1, -2))  # [B, Hkv, G, L]
        scores.masked_fill_(self.pad, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v)  # [B, Hkv, G, D]: P Vb
        for g, table in lr_values:
            p = probs if g.rows.shape[0] == B else probs.index_select(0, g.rows)
            plv = torch.bmm(p.view(-1, Hq, L), table)  # [b, Hq, r]: P Lv
            bv = g.adapter.weights[(layer, "v_proj")][1].view(-1, Hkv, D).transpose(0, 1)  # [Hkv, r, D]
            term = torch.matmul(plv.view(-1, Hkv, G, plv.shape[-1]), bv).mul_(g.adapter.scaling)
            if g.rows.shape[0] == B:
                out.add_(term)
            else:
                out.index_add_(0, g.rows, term)
        return out.reshape(B, Hq * D)


def _pool_rows(read: KVRead) -> torch.Tensor:
    rows = read.rows
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop)
    return rows.cpu()


def _batchable(row: RowAttention, n_keys: int, max_keys: int) -> bool:
    return (
        row.q_rows.stop - row.q_rows.start == 1
        and n_keys <= max_keys
        and row.window is None
        and len(row.reads) > 0
        and all(r.pool is row.reads[0].pool for r in row.reads)
    )


def _buckets(rows: list[tuple[RowAttention, int]]) -> list[list[tuple[RowAttention, int]]]:
    """Rows (with their key counts) longest first, cut where padding would pass :data:`PAD_SLACK`."""
    out, current, total = [], [], 0
    for row, n in sorted(rows, key=lambda rn: -rn[1]):
        if current and current[0][1] * (len(current) + 1) > PAD_SLACK * (total + n):
            out.append(current)
            current, total = [], 0
        current.append((row, n))
        total += n
    if current:
        out.append(current)
    return out


def _bucket(rows: list[tuple[RowAttention, int]]) -> DecodeBucket:
    pool = rows[0][0].reads[0].pool
    device = pool.k.device
    B, L = len(rows), rows[0][1]
    slots = torch.zeros(B, L, dtype=torch.long)
    pad = torch.ones(B, L, dtype=torch.bool)
    groups: dict[tuple, dict] = {}
    for b, (row, _) in enumerate(rows):
        col = 0
        for read in row.reads:
            idx = _pool_rows(read)
            m = idx.shape[0]
            slots[b, col : col + m] = idx
            pad[b, col : col + m] = False
            if read.adapter is not None and read.lr_cols is not None:
                ck, cv = read.lr_cols
                key = (id(read.adapter), ck.start, ck.stop, cv.start, cv.stop)
                g = groups.setdefault(key, {"adapter": read.adapter, "cols": read.lr_cols, "slots": []})
                g["slots"].append((b, col, m, read))
            col += m
    built = []
    for g in groups.values():
        rows_g = sorted({b for b, _, _, _ in g["slots"]})
        local_of = {b: i for i, b in enumerate(rows_g)}
        b_idx = torch.cat([torch.full((m,), b) for b, _, m, _ in g["slots"]])
        l_idx = torch.cat([torch.arange(c, c + m) for _, c, m, _ in g["slots"]])
        local = torch.cat([local_of[b] * L + torch.arange(c, c + m) for b, c, m, _ in g["slots"]])
        with_rope = all(r.cos is not None for _, _, _, r in g["slots"])
        cos = torch.cat([r.cos for _, _, _, r in g["slots"]]) if with_rope else None
        sin = torch.cat([r.sin for _, _, _, r in g["slots"]]) if with_rope else None
        built.append(
            _LRGroup(
                g["adapter"],
                g["cols"],
                b_idx.to(device),
                l_idx.to(device),
                slots[b_idx, l_idx].to(device),
                torch.tensor(rows_g, device=device),
                local.to(device),
                cos,
                sin,
            )
        )
    q_rows = torch.tensor([row.q_rows.start for row, _ in rows], device=device)
    Hkv = pool.k.shape[-2]
    head_slots = (slots[:, None, :] * Hkv + torch.arange(Hkv)[None, :, None]).reshape(-1)
    return DecodeBucket(
        pool, q_rows, slots.to(device), head_slots.to(device), pad.view(B, 1, 1, L).to(device), tuple(built)
    )


@dataclass(frozen=True)
class DecodeBatches:
    """A forward's rows split: ``buckets`` of at least two one-query rows each, and ``rest``, the
    rows left to the per-row path (prefill rows, multi-query rows, windowed rows, lone rows)."""

    buckets: tuple[DecodeBucket, ...]
    rest: tuple[RowAttention, ...]


def decode_batches(rows: tuple[RowAttention, ...]) -> DecodeBatches:
    """Bucket the batchable rows of a forward (:class:`DecodeBatches`), once per forward."""
    batchable, rest = [], []
    max_keys = batch_max_keys()
    for row in rows:
        n_keys = sum(r.end - r.start for r in row.reads)
        if _batchable(row, n_keys, max_keys):
            batchable.append((row, n_keys))
        else:
            rest.append(row)
    buckets = []
    for part in _buckets(batchable):
        if len(part) < 2:
            rest.extend(row for row, _ in part)
        else:
            buckets.append(_bucket(part))
    return DecodeBatches(tuple(buckets), tuple(rest))
