"""The reference backend in plain torch (CPU and CUDA): each row's reads are materialised for the
layer (contiguous pool pieces as views, scattered ones gathered) and fed to the segment maths of
:mod:`precache.cache.attention.segments`; one-query decode rows of similar lengths run as padded
batches (:mod:`precache.cache.attention.decode_batch`)."""

from __future__ import annotations

import torch

from precache.cache.attention.base import AttentionBackend, BatchMetadata, KVRead, register_backend
from precache.cache.attention.decode_batch import DecodeBatches, decode_batches
from precache.cache.attention.segments import Segment, attend


def segment_at(read: KVRead, layer: int, model) -> Segment:
    """``read`` at ``layer``: keys get the RoPE'd LoRA part, values keep the LR term apart (in the
    model's dtype: a pool of another ``kv_cache_dtype`` is widened here)."""
    pool = read.pool
    k, v = pool.k[layer][read.rows].to(model.dtype), pool.v[layer][read.rows].to(model.dtype)
    adapter = read.adapter
    if adapter is None or read.lr_cols is None:
        return Segment(k, v, read.start)
    lr = pool.lr[layer][read.rows].to(model.dtype)
    if adapter.has(layer, "k_proj"):
        delta = adapter.up(lr[:, read.lr_cols[0]], layer, "k_proj").view(k.shape)
        k = k + model.rope.apply(delta, read.cos, read.sin)  # RoPE is linear: RoPE(Kb_lin + d) = Kb + RoPE(d)
    if adapter.has(layer, "v_proj"):
        bv = adapter.weights[(layer, "v_proj")][1]
        return Segment(k, v, read.start, lr[:, read.lr_cols[1]], bv, adapter.scaling)
    return Segment(k, v, read.start)


@register_backend
class TorchBackend(AttentionBackend):
    """One SDPA call per prefill row, an explicit softmax per decode row (segments read in place),
    one padded batch per bucket of similar-length one-query decode rows; a row's sliding window
    (:meth:`RowAttention.window_at`) is applied at each layer.

    ``batch_decode=False`` runs every row alone (the per-row reference the batched path is tested
    against)."""

    name = "torch"

    def __init__(self, batch_decode: bool = True):
        self.batch_decode = batch_decode

    def prepare(self, meta: BatchMetadata, model) -> None:
        """Bucket the one-query decode rows and gather their key slots (once per forward); the
        other rows materialise their reads at each layer from ``meta.rows``."""
        meta.prepared = decode_batches(meta.rows) if self.batch_decode else DecodeBatches((), meta.rows)

    def forward(self, q: torch.Tensor, layer: int, meta: BatchMetadata, model) -> torch.Tensor:
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        prepared = meta.prepared
        if not isinstance(prepared, DecodeBatches):  # prepared by another backend (a refusing one)
            prepared = DecodeBatches((), meta.rows)
        for bucket in prepared.buckets:
            out[bucket.q_rows] = bucket.attend(q, layer, model)
        for row in prepared.rest:
            window = row.window_at(layer)
            # reads wholly before the first query's window are never materialised
            first_visible = -1 if window is None else row.q_start - window + 1
            segments = [segment_at(read, layer, model) for read in row.reads if read.end > first_visible]
            out[row.q_rows] = attend(q[row.q_rows], row.q_start, segments, window)
        return out
