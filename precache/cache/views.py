"""What a :class:`~precache.cache.rowplan.View` reads: the attention metadata's reads on the hot
path (:func:`view_reads`), and the materialised keys and values for diagnostics and tests
(:func:`materialise_view`)."""

from __future__ import annotations

import torch

from precache.cache.attention import KVRead
from precache.cache.attention.torch_backend import segment_at
from precache.cache.rowplan import View


def view_reads(model, view: View, split_runs: bool) -> list[KVRead]:
    """:class:`KVRead` s of ``view``: one per contiguous piece when ``split_runs`` (decode rows read
    the pool in place), else one over the whole range (pool rows gathered when scattered)."""
    if view.end <= view.start:
        return []
    lr_cols = cos = sin = None
    if view.lr is not None and view.adapter is not None:
        lr_cols = (view.lr.cols_k, view.lr.cols_v)
    pieces = (
        [(s, e, slice(r, r + e - s)) for s, e, r in view.store.runs(view.start, view.end)]
        if split_runs
        else [(view.start, view.end, view.store.rows(view.start, view.end))]
    )
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
