"""Attention of the captured decode step (:mod:`precache.models.step_graph`) over a row's view of
the block pool, in the two layouts :class:`~precache.models.contract.DecodeStepInputs` describes.

- **Gathered** (any batch): row ``b``'s keys are pool rows ``slots[b]``; the graph gathers them
  (and their LR rows) into a copy and takes the row's own key from what the step computed.
- **Window** (one row whose other keys fill at most :data:`MAX_RUNS` runs of contiguous pool
  rows, as a trajectory's blocks lie after a prefill and its appends, behind a cached prompt
  prefix): the pools arrive as views of each run ``[n_layers, W_r, ...]``, read in place by the
  score and value products; the row's own key is the last. At 5,000 keys the gathered layout's
  copy made attention about three times as slow as reading the runs in place
  (benchmarks/RESULTS.md, "Compiled decode step").

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
    layout, tuples of views of each run's rows), read only, in any KV-cache dtype; ``visible`` ``[B, L]`` bool;
    ``key_rope``: each key's ``cos``, ``sin`` ``[B, L, head_dim]``.
    """
    stacks, (own_k, own_v, own_lr), (pool_k, pool_v, pool_lr) = inp.stacks, own, pools
    B, L = inp.slots.shape
    dtype = qh.dtype
    if inp.window:  # [W_r, Hkv, D] views of the pool (copies only when widened)
        s_runs = [torch.matmul(qh, k[layer].to(dtype).permute(1, 2, 0).unsqueeze(0)) for k in pool_k]
        s_own = (qh * own_k.unsqueeze(2)).sum(-1, keepdim=True)  # [1, Hkv, G, 1]
        scores = torch.cat([*s_runs, s_own], dim=-1)  # [1, Hkv, G, L]
    else:
        is_self = inp.is_self[:, :, None, None]
        keys = torch.where(is_self, own_k.unsqueeze(1), pool_k[layer][inp.slots].to(dtype))
        scores = torch.matmul(qh, keys.permute(0, 2, 3, 1))  # [B, Hkv, G, L]
    lv = None
    if inp.lr_cols.shape[1] > 0:  # the row's LR part: rows Lk, Lv of its adapter's columns
        own_cols = torch.gather(as_stored(own_lr, pool_lr), 1, inp.lr_cols)[:, None, :]  # [B, 1, rk + rv]
        if inp.window:
            runs = [lr_run[layer][:, inp.lr_cols[0]].to(dtype).unsqueeze(0) for lr_run in pool_lr]
            lr = torch.cat([*runs, own_cols], dim=1)
        else:
            lr = pool_lr[layer][inp.slots].to(dtype)
            lr = torch.gather(lr, 2, inp.lr_cols[:, None, :].expand(B, L, -1))
            lr = torch.where(inp.is_self[:, :, None], own_cols, lr)
        lr = torch.where(inp.lr_on[:, :, None], lr, 0.0)  # rows of other stores hold no LR rows
        rank_k = inp.lr_cols.shape[1] // 2
        lk, lv = lr[..., :rank_k], lr[..., rank_k:]
        if "k_proj" in stacks:
            Hkv, D = qh.shape[1], qh.shape[3]
            delta = torch.bmm(lk, stacks["k_proj"][1][inp.lr_adapter, layer]).view(B, L, Hkv, D)
            delta = RotaryEmbedding.apply(delta, *key_rope)
            scores = scores + torch.matmul(qh, delta.permute(0, 2, 3, 1))
    probs = _softmax(scores, visible).to(dtype)
    if inp.window:
        out, start = probs[..., -1:] * own_v.unsqueeze(2), 0  # [1, Hkv, G, D]
        for v in pool_v:
            end = start + v.shape[1]
            out = out + torch.matmul(probs[..., start:end], v[layer].to(dtype).permute(1, 0, 2).unsqueeze(0))
            start = end
    else:
        is_self = inp.is_self[:, :, None, None]
        values = torch.where(is_self, own_v.unsqueeze(1), pool_v[layer][inp.slots].to(dtype))
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [B, Hkv, G, D]: P Vb
    if lv is not None and "v_proj" in stacks:
        Hkv, G, D = qh.shape[1], qh.shape[2], qh.shape[3]
        plv = torch.matmul(probs.reshape(B, Hkv * G, L), lv)  # [B, Hq, rv]: P Lv
        bv = stacks["v_proj"][1][inp.lr_adapter, layer].view(B, -1, Hkv, D).permute(0, 2, 1, 3)
        out = out + torch.matmul(plv.view(B, Hkv, G, -1), bv)  # + s (P Lv) B^v
    return out


def _softmax(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension in fp32, masked keys 0."""
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf")).float()
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    # the denominator as a product with ones, not a sum: inductor's C++ code for a float sum over
    # more than 4,096 elements differs and is chosen behind a guard on the key count, which
    # recompiled the step once a context passed 4,096 keys
    return weights / torch.matmul(weights, weights.new_ones(scores.shape[-1], 1))
