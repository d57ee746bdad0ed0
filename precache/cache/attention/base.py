"""The batch-level attention interface: metadata built once per forward, one call per layer.

A forward's rows (sequences of the flattened batch) each read some cache ranges; the method's
row plans say which (:mod:`precache.cache.rowplan`). :class:`BatchMetadata` records, for every row,
its query rows in the batch, its first position (causal offset) and the ranges it reads, as pool
rows (a slice per contiguous piece, or an index tensor) plus the LR part the row's adapter adds:
``Lk``/``Lv`` columns of the pool's LR rows and the adapter whose ``B^k``/``B^v`` lift them.
A backend derives what its kernel reads from that once per forward (:meth:`AttentionBackend.prepare`,
kept on the metadata), then turns it into attention output one layer at a time; a kernel is one new
:class:`AttentionBackend` subclass registered with :func:`register_backend`, nothing else changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from precache.registry import Registry

if TYPE_CHECKING:
    from precache.cache.pool import KVPool
    from precache.lora.adapter import LoRAAdapter
    from precache.models.contract import KVProjector


@dataclass(frozen=True)
class KVRead:
    """Positions ``[start, end)`` of one cache, stored at pool rows ``rows``.

    ``adapter``/``lr_cols`` (``(k columns, v columns)`` of ``pool.lr``): the agent's LR part,
    ``K = Kb + RoPE(s Lk B^k)`` and ``V = Vb + s Lv B^v`` (DESIGN.md, Notation); None reads the
    stored keys and values as they are (a base or full cache). ``cos``/``sin`` ``[end - start,
    head_dim]``: RoPE tables of the range, set when the adapter has a k_proj LoRA.
    """

    pool: KVPool
    start: int
    end: int
    rows: slice | torch.Tensor
    adapter: LoRAAdapter | None = None
    lr_cols: tuple[slice, slice] | None = None
    cos: torch.Tensor | None = field(default=None, repr=False)
    sin: torch.Tensor | None = field(default=None, repr=False)


@dataclass(frozen=True)
class RowAttention:
    """One row: queries ``q_rows`` of the batch at positions ``[q_start, q_start + T)``, reading ``reads``
    (in position order; key position ``p`` is visible to query position ``t`` when ``p <= t``).

    ``window``: the sliding window of every layer in tokens, ``window[layer]`` None where the layer
    attends to the whole prefix; None when no layer has one. At a windowed layer key ``p`` is
    visible to query ``t`` only when ``t - window < p <= t`` (transformers'
    ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``). The reads still cover the
    whole prefix: blocks that fell out of every window stay allocated (a backend skips them).
    """

    q_rows: slice
    q_start: int
    reads: tuple[KVRead, ...]
    window: tuple[int | None, ...] | None = None

    def window_at(self, layer: int) -> int | None:
        """Sliding window of ``layer`` in tokens, or None (full causal attention)."""
        return None if self.window is None else self.window[layer]


@dataclass
class BatchMetadata:
    """Everything a backend needs about one forward, built once before the first layer.

    ``prepared``: what the backend running the forward derived from ``rows`` for every layer
    (:meth:`AttentionBackend.prepare`; None until then). Only ``prepare`` sets it.
    """

    rows: tuple[RowAttention, ...]
    num_tokens: int
    prepared: object | None = field(default=None, repr=False, compare=False)


class AttentionBackend(ABC):
    """Attention of every row of a forward at one layer.

    Per forward the caller builds one :class:`BatchMetadata`, calls :meth:`prepare` on it once
    (again whenever it builds a new one, e.g. after narrowing the batch), then :meth:`forward` at
    every layer. What a backend derives from the metadata for every layer (slot tables, tiles,
    stacked adapter weights) it builds in :meth:`prepare` and keeps on ``meta.prepared``, never in
    the backend: one backend object serves any number of forwards.

    :meth:`forward` takes the queries ``q`` ``[N, n_heads, head_dim]`` (after RoPE) and returns
    ``[N, n_heads * head_dim]``; GQA maps query head ``h`` to kv head ``h // (n_heads / n_kv_heads)``
    (HF ``repeat_kv`` order). The cache entries of this forward are already written when it runs.
    """

    name: ClassVar[str]

    @abstractmethod
    def prepare(self, meta: BatchMetadata, model: KVProjector) -> None:
        """Derive what every layer of this forward needs from ``meta`` and store it on
        ``meta.prepared`` (``model``: config, dtype, device, RoPE tables), once per forward."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, layer: int, meta: BatchMetadata, model: KVProjector
    ) -> torch.Tensor: ...


#: the attention backends by name (``Engine(attention_backend=...)``)
BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend", ValueError, noun="backend")


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make ``cls`` available as ``get_backend(cls.name)``."""
    return BACKENDS.register(cls.name, cls)


def get_backend(name: str) -> AttentionBackend:
    """A new backend by name.

    Raises:
        ValueError: no backend has that name.
    """
    return BACKENDS[name]()
