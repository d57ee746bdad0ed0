"""Row plans: the records a sharing method hands the runner (:func:`precache.cache.plan.run_plans`).

A sharing method turns "agent c processes these tokens" into one or more :class:`RowPlan` s: the
tokens, their positions and adapter, the cache entries the row writes from its hidden states
(:class:`BaseWrite`, :class:`FullWrite`, :class:`LRWrite`) and the cache ranges it reads
(:class:`View`).

Selective recomputation (CacheBlend, DroidSpeak, RelayCaching) is a row with a :class:`Recompute`:
tokens that already have cache entries run again with the row's adapter, writing only at some
layers, and the row narrows at a layer boundary to the tokens a selection keeps
(:class:`~precache.cache.planned_attention.PlannedAttention`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from precache.cache.pool import LRView, PagedStore
from precache.lora.adapter import LoRAAdapter
from precache.models.contract import LayerInput, Row


@dataclass(frozen=True)
class BaseWrite:
    """Base cache entries ``Kb = RoPE(h W_k)``, ``Vb = h W_v`` from the row's hidden states.

    ``skip`` leading tokens of the row are not written (BaseShared keeps an existing base entry).
    """

    store: PagedStore
    skip: int = 0

    @property
    def paged(self) -> PagedStore:
        """The store whose blocks the write fills."""
        return self.store


@dataclass(frozen=True)
class FullWrite:
    """Full KV-cache entries with the row's own adapter (NonShared, FullShared, a turn's own tokens)."""

    store: PagedStore

    @property
    def paged(self) -> PagedStore:
        """The store whose blocks the write fills."""
        return self.store


@dataclass(frozen=True)
class LRWrite:
    """LR cache entries ``h A_a^k``, ``h A_a^v`` of ``adapter`` from the row's hidden states."""

    store: LRView
    adapter: LoRAAdapter

    @property
    def paged(self) -> PagedStore:
        """The store whose blocks the write fills (the LR columns live in the base store's blocks)."""
        return self.store.store


Write = BaseWrite | FullWrite | LRWrite


@dataclass(frozen=True)
class View:
    """Keys/values of ``store`` at positions ``[start, end)``, plus ``adapter``'s LR part from ``lr``
    (an :class:`LRView` of the same store's blocks)."""

    store: PagedStore
    start: int
    end: int
    lr: LRView | None = None
    adapter: LoRAAdapter | None = None


#: ``select(x, rows, positions)``: the row-local indices ``[kept]`` (ascending, on the device) of
#: the tokens that go on, given the layer input ``x``, the row's batch slice and its token positions
Selector = Callable[[LayerInput, slice, list[int]], torch.Tensor]


@dataclass(frozen=True)
class Recompute:
    """Selective recomputation of a row whose tokens already have cache entries.

    The row runs layers ``0 .. last_layer`` (None: every layer) and writes its cache entries only
    at layers ``>= first_write`` (the others keep what the cache holds). With ``select``: after
    layer ``select_layer`` only the ``kept`` tokens that ``select`` returns go on (their entries
    are rewritten at the later layers; the dropped ones keep what the layer wrote last). Such a row
    never carries logits. ``num_layers`` is the model's layer count, for :meth:`cost`.

    Raises:
        ValueError: a layer out of range, or ``kept`` without ``select``.
    """

    num_layers: int
    first_write: int = 0
    last_layer: int | None = None
    select_layer: int | None = None
    select: Selector | None = field(default=None, repr=False)
    kept: int | None = None

    def __post_init__(self):
        last = self.num_layers - 1 if self.last_layer is None else self.last_layer
        if not 0 <= self.first_write <= last < self.num_layers:
            raise ValueError(
                f"recompute layers {self.first_write}..{last} are not within 0..{self.num_layers - 1}"
            )
        if (self.select is None) != (self.select_layer is None) or (self.select is None) != (
            self.kept is None
        ):
            raise ValueError("a selection needs select, select_layer and kept together")
        if self.select_layer is not None and not 0 <= self.select_layer < last:
            raise ValueError(f"select_layer {self.select_layer} must come before the last layer {last}")

    @property
    def end_layer(self) -> int:
        """The last layer the row runs."""
        return self.num_layers - 1 if self.last_layer is None else self.last_layer

    def token_layers(self, n: int) -> int:
        """Token-layers the row computes for ``n`` tokens: every layer it runs, written or not."""
        if self.select_layer is None:
            return n * (self.end_layer + 1)
        return n * (self.select_layer + 1) + self.kept * (self.end_layer - self.select_layer)

    def cost(self, n: int) -> int:
        """Prefill cost in tokens: :meth:`token_layers` over the layer count, rounded up."""
        return math.ceil(self.token_layers(n) / self.num_layers)


@dataclass
class RowPlan:
    """One row of a forward: tokens at positions ``[pos0, pos0 + len(token_ids))`` run with ``adapter``.

    ``recompute``: the row re-runs tokens selectively (:class:`Recompute`); ``prefill_cost`` is
    what it counts as prefill work (tokens; a recompute row counts its token-layers over the layer
    count)."""

    token_ids: list[int]
    pos0: int
    adapter: LoRAAdapter | None
    writes: list[Write]
    views: list[View]
    want_logits: bool = True
    recompute: Recompute | None = None
    row: Row | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.pos0 + len(self.token_ids)

    @property
    def prefill_cost(self) -> int:
        n = len(self.token_ids)
        return n if self.recompute is None else self.recompute.cost(n)

    def write_start(self, w: Write) -> int:
        """The first position ``w`` writes (a :class:`BaseWrite` skips its ``skip`` leading tokens)."""
        return self.pos0 + (w.skip if isinstance(w, BaseWrite) else 0)
