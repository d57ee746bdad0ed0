"""Attention of the captured decode step (:mod:`precache.models.step_graph`) over a row's view of
the block pool, in the two layouts :class:`~precache.models.contract.DecodeStepInputs` describes.

- **Gathered** (any batch): row ``b``'s keys are pool rows ``slots[b]``; the graph gathers them
  (and their LR rows) into a copy and takes the row's own key from what the step computed.
- **Window** (one row whose other keys fill at most :data:`MAX_RUNS` runs of contiguous pool
  rows, as a trajectory's blocks lie after a prefill and its appends, behind a cached prompt
  prefix): the pools arrive as views of each run ``[n_layers, W_r, ...]``, read in place by the
  score and value products; the row's own key is the last.

In both, the scores are a sum inductor writes as one loop over the keys in pool order
(:func:`_scores`), each key read once (a gathered one where it lies, never copied); the values are,
in the window layout, a sum over chunks of the values as they lie (:func:`_weighted_values`), in
the gathered layout for one row the same sum reading each value through its slot
(:func:`_gathered_values`), and for a batch a product per head of the gathered copy (half the flat
product's time there: benchmarks/RESULTS.md, "Compiled decode step"). The LR value term ``P Lv`` is, in the window
layout, a sum in chunks over each run's LR rows as they lie (:func:`_window_lr_values`: PreLRShared's step in
0.88-0.95 of the time it took with the rows' column gather and copy, paired medians), and in the
gathered layout a product with the gathered rows.

Both compute the same maths (module docstring of step_graph; DESIGN.md "Notation"): scores
``q K^T / sqrt(D)`` over the visible keys, ``K = Kb + lr_on RoPE(s Lk B^k)``, softmax in fp32,
``P Vb + s (P Lv) B^v``.
"""

from __future__ import annotations

import torch

from precache.models.contract import DecodeStepInputs
from precache.models.rope import RotaryEmbedding

#: runs of pool rows a window row may read (each count is a graph of its own): one for a
#: trajectory laid out in one run, two behind a prompt prefix cached by another trajectory
MAX_RUNS = 2


def as_stored(t: torch.Tensor, pool: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``t`` as ``pool`` (a pool tensor or views of it) will hold it once written, back in ``t``'s
    dtype (a no-op when the pool has the model's dtype): the eager forward writes a token's
    entries first and then reads them."""
    dtype = pool[0].dtype if isinstance(pool, tuple) else pool.dtype
    return t if dtype == t.dtype else t.to(dtype).to(t.dtype)


def attend(
    inp: DecodeStepInputs,
    layer: int,
    qh: torch.Tensor,
    own: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    pools: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    visible: torch.Tensor,
    key_rope: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """One layer's attention output ``[B, n_kv_heads, group, head_dim]``.

    ``qh`` ``[B, n_kv_heads, group, head_dim]``: the queries after RoPE, scaled by ``1/sqrt(D)``;
    ``own``: the row's own key and value ``[B, n_kv_heads, head_dim]`` (after RoPE, rounded as the
    pool will hold them) and its LR row ``[B, C]`` (None without LR writes); ``pools``: the pool's
    K, V ``[n_layers, rows, n_kv_heads, head_dim]`` and LR ``[n_layers, rows, C]`` (in the window
    layout, tuples of views of each run's rows, the values' runs :data:`VALUE_PAD` rows longer),
    read only, in any KV-cache dtype; ``visible`` ``[B, L]`` bool; ``key_rope``: each key's ``cos``,
    ``sin`` ``[B, L, head_dim]``.

    The softmax is taken apart (:func:`_exp_scores`): the values are weighted by the unnormalised
    ``exp`` and the output divided by the sum once, in fp32.
    """
    stacks, (own_k, own_v, own_lr), (pool_k, pool_v, pool_lr) = inp.stacks, own, pools
    B, L = inp.slots.shape
    Hkv, G, D = qh.shape[1], qh.shape[2], qh.shape[3]
    dtype = qh.dtype
    queries = qh[:, None]  # [B, 1, Hkv, G, D], against keys [B, L, Hkv, 1, D]
    delta = lv = own_cols = None
    rank_k = inp.lr_cols.shape[1] // 2
    if inp.lr_cols.shape[1] > 0:  # the row's LR part: rows Lk, Lv of its adapter's columns
        own_cols = torch.gather(as_stored(own_lr, pool_lr), 1, inp.lr_cols)[:, None, :]  # [B, 1, rk + rv]
    # every key's LR rows as a copy: the gathered layout's, and a window row's key columns for its
    # key term (its value term reads the runs in place: _window_lr_values)
    if own_cols is not None and (not inp.window or "k_proj" in stacks):
        if inp.window:  # the key columns only: the value term reads the runs in place
            cols = inp.lr_cols[0, :rank_k]
            runs = [lr_run[layer][:, cols].to(dtype).unsqueeze(0) for lr_run in pool_lr]
            lr = torch.cat([*runs, own_cols[..., :rank_k]], dim=1)
        else:
            lr = pool_lr[layer][inp.slots].to(dtype)
            lr = torch.gather(lr, 2, inp.lr_cols[:, None, :].expand(B, L, -1))
            lr = torch.where(inp.is_self[:, :, None], own_cols, lr)
        lr = torch.where(inp.lr_on[:, :, None], lr, 0.0)  # rows of other stores hold no LR rows
        lk, lv = lr[..., :rank_k], lr[..., rank_k:]
        if "k_proj" in stacks:  # s RoPE(Lk B^k), [B, L, Hkv, D]
            delta = torch.bmm(lk, stacks["k_proj"][1][inp.lr_adapter, layer]).view(B, L, Hkv, D)
            delta = RotaryEmbedding.apply(delta, *key_rope)
    if inp.window:  # [W_r, Hkv, D] views of the pool, read in place (widened as read)
        s_runs = [_scores(queries, k[layer].to(dtype).unsqueeze(0)) for k in pool_k]
        scores = torch.cat([*s_runs, _scores(queries, own_k[:, None])], dim=1)  # [1, L, Hkv, G]
        if delta is not None:
            scores = scores + _scores(queries, delta)
    else:  # the gathered keys are read inside the score loop (never copied), the values copied
        keys = torch.where(
            inp.is_self[:, :, None, None], own_k.unsqueeze(1), pool_k[layer][inp.slots].to(dtype)
        )
        scores = _scores(queries, keys if delta is None else keys + delta)  # [B, L, Hkv, G]
    weights, total = _exp_scores(scores, visible)  # [B, L, Hkv, G], [B, Hkv, G, 1]
    if inp.window:
        out, start = weights[:, -1, :, :, None] * own_v.float().unsqueeze(2), 0  # [1, Hkv, G, D]
        for k, v in zip(pool_k, pool_v, strict=True):
            out = out + _weighted_values(weights[0], start, k.shape[1], v[layer])
            start = start + k.shape[1]
    elif B == 1:  # one row: its values summed in chunks, each read where it lies in the pool
        out = _gathered_values(weights, inp.slots, inp.is_self, own_v, pool_v[layer])
    else:
        values = torch.where(
            inp.is_self[:, :, None, None], own_v.unsqueeze(1), pool_v[layer][inp.slots].to(dtype)
        )
        # per head (the gathered copy is made anyway): 0.8 against the flat product's 1.7 ms a
        # layer at 16 rows of 300 keys (the flat one computes every head against every head)
        out = torch.matmul(weights.permute(0, 2, 3, 1).to(dtype), values.permute(0, 2, 1, 3)).float()
    if own_cols is not None and "v_proj" in stacks:
        if inp.window:  # [1, Hq, rv]: P Lv
            plv = _window_lr_values(weights[0], inp, layer, pool_lr, own_cols[0, 0], rank_k).unsqueeze(0)
            plv = plv.to(dtype)
        else:
            plv = torch.bmm(weights.view(B, L, Hkv * G).transpose(1, 2).to(dtype), lv)  # [B, Hq, rv]: P Lv
        bv = stacks["v_proj"][1][inp.lr_adapter, layer].view(B, -1, Hkv, D).permute(0, 2, 1, 3)
        out = out + torch.matmul(plv.view(B, Hkv, G, -1), bv).float()  # + s (P Lv) B^v
    return (out / total).to(dtype)


def _scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q . k`` for queries ``[B, 1, Hkv, G, D]`` and keys ``[B, L, Hkv, D]`` (as they lie in the
    pool): ``[B, L, Hkv, G]``. Written as a product and a sum over ``D``, not a matrix product: inductor
    makes one loop over the keys in pool order, each key read once (and a gather read in place),
    where MKL's batched ``[G, D] x [D, L]`` per head took 3-4x as long on SmolLM2's 3 KV heads of 3
    queries (benchmarks/RESULTS.md, "Compiled decode step"). In fp32 whatever the model's dtype (as
    a matrix product accumulates; the scores go to the fp32 softmax): bf16 products rounded one by
    one put a bf16 model's logits 0.2 from the eager forward's."""
    return (keys[:, :, :, None, :].float() * queries.float()).sum(-1)


#: keys a partial sum covers, in :func:`_exp_scores` and :func:`_weighted_values`: a chunk's values
#: (48 KB of SmolLM2's fp32 values) stay in the core's cache while every head and query reads them
VALUE_CHUNK = 64

#: rows a window row's value runs reach past their last key (read, then zeroed): ``pool_v``'s runs
#: arrive this much longer than ``pool_k``'s, the pool keeping as many spare rows past its end
#: (:class:`precache.cache.pool.KVPool`)
VALUE_PAD = 2 * VALUE_CHUNK


def _chunk_count(L) -> int:
    """Chunks of :data:`VALUE_CHUNK` keys a sum over ``L`` keys covers: one or two more than the
    keys fill, never 1 (a size of 1 would be specialised, a guard ``L <= 64``); an expression of
    ``L``, so a growing context keeps one graph."""
    return L // VALUE_CHUNK + 2


def _in_chunks(t: torch.Tensor, dim: int, L) -> torch.Tensor:
    """``t``, ``L`` keys long along ``dim``, padded with zeros to :func:`_chunk_count` whole chunks
    and viewed with ``dim`` as ``[chunks, VALUE_CHUNK]``."""
    chunks = _chunk_count(L)
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, chunks * VALUE_CHUNK - L]
    t = torch.nn.functional.pad(t, pad)
    return t.view(*t.shape[:dim], chunks, VALUE_CHUNK, *t.shape[dim + 1 :])


def _exp_scores(scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax's numerator and denominator, apart: for ``scores`` ``[B, L, Hkv, G]``,
    ``exp(s - max_l s)`` ``[B, L, Hkv, G]`` in fp32 (keys not ``visible`` ``[B, L]`` give 0) and its
    sum over the keys ``[B, Hkv, G, 1]``; the caller divides the weighted values by the sum once
    (``D`` divisions a query, not ``L``).

    Kept in the keys-first layout the scores come in: permuted to keys-last, inductor wrote the
    ``exp`` over the keys as a scalar loop (one ``std::exp`` per key, head and query) and redid the
    division in the value loop (benchmarks/RESULTS.md, "Compiled decode step"). The sum is taken in
    chunks of :data:`VALUE_CHUNK` keys: inductor's C++ code for one float sum over more than 4,096
    elements is chosen behind a guard on the length, a recompile once a context passed 4,096 keys;
    here the guard falls on the chunk count (4,096 chunks, 262,144 keys). The chunks are summed
    first (one loop over them, vectorised over a chunk's keys, heads and queries), then a chunk's
    keys: summed the other way round, inductor split each chunk's 64-key sum over the threads, one
    parallel region a chunk (0.06-0.16 ms a layer at 4,000 keys; benchmarks/RESULTS.md)."""
    scores = scores.float().masked_fill(~visible[:, :, None, None], float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=1, keepdim=True))
    total = _in_chunks(weights, 1, weights.shape[1]).sum(1).sum(1)
    return weights, total[..., None]


def _weighted_values(weights: torch.Tensor, start, W, values: torch.Tensor) -> torch.Tensor:
    """``P V`` for one row over one run of the pool, unnormalised: ``weights`` ``[L, Hkv, G]`` (every
    key of the row, fp32), of which keys ``start .. start + W`` are the run's; ``values``
    ``[W + VALUE_PAD, Hkv, D]``, the run's values as they lie in the pool and the rows after them
    (any KV-cache dtype, widened as read); ``[Hkv, G, D]`` in fp32.

    A sum over the keys in chunks of :data:`VALUE_CHUNK` (each chunk's partial sums, then their sum),
    not a matrix product: MKL's ``[G, W] x [W, D]`` walks the values panel by panel, reading them
    at 5-8 GB/s from memory, while a chunk read once stays in cache for every head and query
    (benchmarks/RESULTS.md, "Values in chunks"). The values are read as a view of whole chunks,
    one or two more than the keys need (one chunk would be specialised with a guard ``W <= 64``);
    the rows past ``W`` (the next keys of the layer, or the pool's spare rows, never written) are
    replaced by 0 with ``where`` (which passes no NaN from them) and weighted 0."""
    chunks = _chunk_count(W)
    n = chunks * VALUE_CHUNK
    Hkv, D = weights.shape[1], values.shape[-1]
    inside = torch.arange(n, device=values.device) < W
    v = torch.where(inside[:, None, None], values[:n].float(), 0.0).view(chunks, VALUE_CHUNK, Hkv, D)
    p = _in_chunks(weights[start : start + W], 0, W)
    part = (p[..., None] * v[:, :, :, None, :]).sum(1)  # [chunks, Hkv, G, D]
    return part.sum(0)


def _gathered_values(
    weights: torch.Tensor,
    slots: torch.Tensor,
    is_self: torch.Tensor,
    own_v: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """``P V`` for rows of the gathered layout, unnormalised: ``weights`` ``[B, L, Hkv, G]`` (fp32),
    key ``l`` of row ``b`` at pool row ``slots[b, l]`` of ``values`` ``[rows, Hkv, D]`` (one layer of
    the pool, any KV-cache dtype, widened as read), or the row's own value ``own_v`` ``[B, Hkv, D]``
    where ``is_self`` ``[B, L]``; ``[B, Hkv, G, D]`` in fp32.

    The sum of :func:`_weighted_values` over chunks of :data:`VALUE_CHUNK` keys, each key's value
    read through its slot inside the loop instead of a gathered copy multiplied per head: for one
    row at 4,000 keys scattered in blocks of 16, 0.53 ms a layer against the copy and product's
    0.72 (a window run's sum 0.29), and ReBaseOwnShared-LP's step in 0.85 of the time
    (benchmarks/RESULTS.md, "Gathered values in chunks"). The keys past ``L`` (padding up to whole
    chunks) read pool row 0 and are replaced by 0 with ``where``."""
    B, L = slots.shape
    chunks = _chunk_count(L)
    n = chunks * VALUE_CHUNK
    own = torch.nn.functional.pad(is_self, [0, n - L])
    slots = torch.nn.functional.pad(slots, [0, n - L])
    inside = torch.arange(n, device=values.device) < L
    v = torch.where(own[:, :, None, None], own_v.float()[:, None], values[slots].float())  # [B, n, Hkv, D]
    v = torch.where(inside[None, :, None, None], v, 0.0).view(B, chunks, VALUE_CHUNK, *values.shape[1:])
    p = _in_chunks(weights, 1, L)  # [B, chunks, VALUE_CHUNK, Hkv, G]
    return (p[..., None] * v[:, :, :, :, None, :]).sum(2).sum(1)


def _window_lr_values(
    weights: torch.Tensor,
    inp: DecodeStepInputs,
    layer: int,
    pool_lr: tuple[torch.Tensor, ...],
    own: torch.Tensor,
    rank_k: int,
) -> torch.Tensor:
    """``P Lv`` ``[Hq, rv]`` (fp32, unnormalised) for a window row: ``weights`` ``[L, Hkv, G]``,
    its keys in run order, its own last; ``pool_lr`` the runs' LR rows ``[n_layers, W_r, C]`` (every
    agent's columns), read in place; ``own`` ``[rk + rv]`` the row's own LR row at its adapter's
    columns. Each run's ``P^T LR`` is a sum over the keys in chunks of :data:`VALUE_CHUNK` over all
    ``C`` columns (a run row's columns lie together: the same bytes as the row's own), then the
    adapter's value columns ``lr_cols[rk:]`` are taken from the ``[Hq, C]`` result; keys whose
    ``lr_on`` is False (rows of another store) count 0."""
    L = weights.shape[0]
    p = weights.reshape(L, -1)  # [L, Hq]
    on = inp.lr_on[0]
    plv = p[-1, :, None] * torch.where(on[-1], own[rank_k:].float(), 0.0)[None, :]
    start = 0
    for lr_run in pool_lr:
        W = lr_run.shape[1]
        lr = torch.where(on[start : start + W, None], lr_run[layer].float(), 0.0)  # [W, C]
        p_run, lr_run_chunks = _in_chunks(p[start : start + W], 0, W), _in_chunks(lr, 0, W)
        part = (p_run[..., None] * lr_run_chunks[:, :, None, :]).sum(1).sum(0)  # [Hq, C]
        plv = plv + part[:, inp.lr_cols[0, rank_k:]]
        start = start + W
    return plv
