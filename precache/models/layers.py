"""The layers every model family builds on: RMSNorm, the projection product (dense, int8 or int4
weights) and the per-row LoRA deltas of a flattened mixed-adapter batch.

A family's module (:mod:`precache.models.llama`) composes these; the captured decode step
(:mod:`precache.models.step_graph`) reuses :func:`rms_norm` and :func:`split_product`, so the eager
forward and the compiled step compute the same maths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from precache.models.contract import Row
from precache.models.quant import QUANTIZED_WEIGHTS

if TYPE_CHECKING:
    from precache.lora.adapter import LoRAAdapter


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) computed in fp32 like HF Llama: ``[..., d] -> [..., d]``."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


#: rows up to which :func:`linear` splits a CPU product over the threads: decode steps and small
#: batches (a 3,000-token prefill measured 5-8% slower split, where MKL's own matrix product
#: already runs on every thread)
SPLIT_LINEAR_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (``x`` ``[N, d_in]``, ``weight`` ``[d_out, d_in]`` -> ``[N, d_out]``), split over
    the torch threads on a CPU at fp32.

    MKL runs a matrix-vector product (decode: a few rows) on one thread, so a decode step streamed
    its weights at one core's bandwidth (12 GB/s on a 2-core AMD EPYC, measured 2026-12-01 in an
    earlier run, in benchmarks/RESULTS.md's git history). Viewing ``weight`` as ``T`` slices of
    ``d_out / T`` output rows (no copy) and multiplying them as one batched product spreads the
    slices over the ``T`` threads; each output is the same dot product over ``d_in``, equal to
    ``F.linear``'s up to float rounding (relative error below 1e-6,
    ``tests/test_forward.py``). Other devices, dtypes (bf16 already runs on every thread),
    and more than :data:`SPLIT_LINEAR_MAX_ROWS` rows keep ``F.linear``. An
    :class:`~precache.models.quant.Int8Weight` or ``Int4Weight`` runs its own kernel.
    """
    if isinstance(weight, QUANTIZED_WEIGHTS):  # int8 / int4 weight-only (precache.models.quant)
        y = weight.matmul(x)
        return y if bias is None else y.add_(bias)
    parts = torch.get_num_threads()
    n_out = weight.shape[0]
    if (
        parts < 2
        or x.dim() != 2
        or x.shape[0] > SPLIT_LINEAR_MAX_ROWS
        or n_out % parts
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
    ):
        return F.linear(x, weight, bias)
    return split_product(x, weight, bias, parts)


def split_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int
) -> torch.Tensor:
    """``x Wᵀ (+ bias)`` as one batched product over ``parts`` slices of ``weight``'s output rows
    (``weight.shape[0]`` divisible by ``parts``): :func:`linear`'s CPU path, and the products of
    the compiled decode step (:mod:`precache.models.step_graph`)."""
    n, d_in = x.shape
    n_out = weight.shape[0]
    y = torch.bmm(
        x.unsqueeze(0).expand(parts, n, d_in), weight.view(parts, n_out // parts, d_in).transpose(1, 2)
    )
    y = y.transpose(0, 1).reshape(n, n_out)
    return y if bias is None else y.add_(bias)


def cat_biases(*biases: torch.Tensor | None, sizes: list[int], like: torch.Tensor) -> torch.Tensor | None:
    """The biases of projections fused into one weight (q/k/v, gate/up), ``[sum(sizes)]``, zeros
    for a projection without one; None when none has a bias."""
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else like.new_zeros(n) for b, n in zip(biases, sizes, strict=True)])


@dataclass(frozen=True)
class AdapterGroups:
    """A forward's rows grouped by adapter, built once per forward (:func:`adapter_groups`):
    ``groups`` holds ``(adapter, tokens)`` per distinct adapter, ``tokens`` a slice when its rows
    are adjacent in the batch, else an index tensor ``[n]`` on the batch's device."""

    groups: tuple[tuple[LoRAAdapter, slice | torch.Tensor], ...]


def adapter_groups(rows: list[Row], device) -> AdapterGroups:
    """Group ``rows`` by adapter (base rows, ``adapter=None``, get no group)."""
    by_adapter: dict[int, tuple[LoRAAdapter, list[Row]]] = {}
    for row in rows:
        if row.adapter is not None and row.end > row.start:
            by_adapter.setdefault(id(row.adapter), (row.adapter, []))[1].append(row)
    groups = []
    for adapter, members in by_adapter.values():
        if all(a.end == b.start for a, b in zip(members, members[1:], strict=False)):
            groups.append((adapter, slice(members[0].start, members[-1].end)))
        else:
            idx = torch.cat([torch.arange(r.start, r.end) for r in members]).to(device)
            groups.append((adapter, idx))
    return AdapterGroups(tuple(groups))


def add_lora(y: torch.Tensor, x: torch.Tensor, rows: AdapterGroups, layer: int, proj: str) -> torch.Tensor:
    """Add each row's LoRA delta ``s (x A) B`` to ``y`` in place, one product pair per adapter over
    all its rows (not one pair per row: 16 per projection at a decode step of 16 rows). ``x``
    ``[N, d_in]``, ``y`` ``[N, d_out]``."""
    for adapter, tokens in rows.groups:
        if not adapter.has(layer, proj):
            continue
        if isinstance(tokens, slice):
            y[tokens] += adapter.delta(x[tokens], layer, proj)
        else:
            y.index_add_(0, tokens, adapter.delta(x.index_select(0, tokens), layer, proj))
    return y
