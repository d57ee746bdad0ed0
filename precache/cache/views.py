"""What a :class:`~precache.cache.rowplan.View` reads: the attention metadata's reads on the hot
path (:func:`view_reads`), and the materialised keys and values for diagnostics and tests
(:func:`materialise_view`)."""

from __future__ import annotations

import torch

from precache.cache.attention import KVRead
from precache.cache.attention.torch_backend import segment_at
from precache.cache.pool import rows_of
from precache.cache.rowplan import View

# A decode row reads a view in place while it lies in at most this many contiguous pool pieces;
# beyond, one gather per layer costs less than a matmul pair (and LR terms) per piece: a trajectory
# swapped back in after preemption lies block by block (measured on SmolLM2, issue 20).
MAX_INPLACE_PIECES = 4


def view_reads(model, view: View, split_runs: bool) -> list[KVRead]:
    """:class:`KVRead` s of ``view``: one per contiguous piece when ``split_runs`` (decode rows read
    the pool in place) and the view lies in at most :data:`MAX_INPLACE_PIECES` pieces, else one over
    the whole range (pool rows gathered when scattered)."""
    if view.end <= view.start:
        return []
    lr_cols = cos = sin = None
    if view.lr is not None and view.adapter is not None:
        lr_cols = (view.lr.cols_k, view.lr.cols_v)
    runs = view.store.runs(view.start, view.end)
    if split_runs and len(runs) <= MAX_INPLACE_PIECES:
        pieces = [(s, e, slice(r, r + e - s)) for s, e, r in runs]
    else:
        pieces = [(view.start, view.end, rows_of(runs, view.store.pool.device))]
    reads = []
    for start, end, rows in pieces:
        if lr_cols is not None and "k_proj" in view.adapter.targets:
            cos, sin = model.rope.span(start, end)  # views of the tables: no op on the device
        reads.append(
            KVRead(view.store.pool, start, end, rows, view.adapter if lr_cols else None, lr_cols, cos, sin)
        )
    return reads


def materialise_view(model, layer: int, view: View) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (after RoPE) and values ``[end - start, n_kv_heads, head_dim]`` that ``view`` reads
    at ``layer``, as new tensors: ``Kb + RoPE(s Lk B^k)``, ``Vb + s Lv B^v`` (DESIGN.md, Notation).
    For diagnostics and tests, never on the hot path."""
    reads = view_reads(model, view, split_runs=False)
    if not reads:
        shape = (0, model.config.num_kv_heads, model.config.head_dim)
        return torch.empty(shape, dtype=model.dtype), torch.empty(shape, dtype=model.dtype)
    seg = segment_at(reads[0], layer, model)
    v = seg.v if seg.lv is None else seg.v + (seg.scaling * (seg.lv @ seg.bv)).view(seg.v.shape)
    return seg.k.clone(), v.clone()
