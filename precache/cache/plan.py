"""Row plans: which cache entries a forward writes from which hidden states, and what each row reads.

A sharing method turns "agent c processes these tokens" into one or more :class:`RowPlan` s;
:class:`PlannedAttention` executes them layer by layer inside the model forward. Writes happen
before the row attends, so new tokens see themselves; lengths are committed by
:func:`commit_plans` once every layer has written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from precache.cache.attention import Segment, attend
from precache.cache.store import KVStore, LRStore
from precache.lora.adapter import LoRAAdapter
from precache.models.llama import LayerInput, Row


@dataclass(frozen=True)
class BaseWrite:
    """Base cache entries ``Kb = RoPE(h W_k)``, ``Vb = h W_v`` from the row's hidden states.

    ``skip`` leading tokens of the row are not written (BaseShared keeps an existing base entry).
    """

    store: KVStore
    skip: int = 0


@dataclass(frozen=True)
class FullWrite:
    """Full KV-cache entries with the row's own adapter (NonShared, FullShared, a turn's own tokens)."""

    store: KVStore


@dataclass(frozen=True)
class LRWrite:
    """LR cache entries ``h A_a^k``, ``h A_a^v`` of ``adapter`` from the row's hidden states."""

    store: LRStore
    adapter: LoRAAdapter


@dataclass(frozen=True)
class View:
    """Keys/values of ``store`` at positions ``[start, end)``, plus ``adapter``'s LR part from ``lr``."""

    store: KVStore
    start: int
    end: int
    lr: LRStore | None = None
    adapter: LoRAAdapter | None = None


@dataclass
class RowPlan:
    """One row of a forward: tokens at positions ``[pos0, pos0 + len(token_ids))`` run with ``adapter``."""

    token_ids: list[int]
    pos0: int
    adapter: LoRAAdapter | None
    writes: list[BaseWrite | FullWrite | LRWrite]
    views: list[View]
    want_logits: bool = True
    row: Row | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.pos0 + len(self.token_ids)


def lr_entries(
    x: LayerInput, sl: slice, adapter: LoRAAdapter
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(h A^k [T, r], h A^v [T, r])`` of tokens ``sl``; None where the adapter skips k or v."""
    h, layer = x.h[sl], x.layer
    lk = adapter.down(h, layer, "k_proj") if adapter.has(layer, "k_proj") else None
    lv = adapter.down(h, layer, "v_proj") if adapter.has(layer, "v_proj") else None
    return lk, lv


def view_segment(model, layer: int, view: View) -> Segment:
    """Materialise ``view`` at ``layer``: keys get the RoPE'd LoRA part, values stay low-rank."""
    k, v = view.store.kv(layer, view.start, view.end)
    if view.adapter is None or view.lr is None:
        return Segment(k, v, view.start)
    lk, lv = view.lr.lr(layer, view.start, view.end)
    adapter = view.adapter
    if adapter.has(layer, "k_proj"):
        cos, sin = model.rope.span(view.start, view.end)
        delta = adapter.up(lk, layer, "k_proj").view(k.shape)
        k = k + model.rope.apply(delta, cos, sin)  # RoPE is linear: RoPE(Kb_lin + d) = Kb + RoPE(d)
    if adapter.has(layer, "v_proj"):
        return Segment(k, v, view.start, lv, adapter.weights[(layer, "v_proj")][1], adapter.scaling)
    return Segment(k, v, view.start)


def _write(x: LayerInput, plan: RowPlan, w: BaseWrite | FullWrite | LRWrite) -> None:
    sl = plan.row.slice
    if isinstance(w, BaseWrite):
        k, v = x.base_kv()
        start = sl.start + w.skip
        if start < sl.stop:
            w.store.write(x.layer, plan.pos0 + w.skip, k[start : sl.stop], v[start : sl.stop])
    elif isinstance(w, FullWrite):
        k, v = x.adapted_kv(sl, plan.adapter)
        w.store.write(x.layer, plan.pos0, k, v)
    else:
        lk, lv = lr_entries(x, sl, w.adapter)
        if lk is not None or lv is not None:
            w.store.write(x.layer, plan.pos0, lk, lv)


class PlannedAttention:
    """The :class:`~precache.models.llama.AttentionBackend` that executes row plans."""

    def __init__(self, plans: list[RowPlan]):
        self.plans = plans

    def attend(self, x: LayerInput) -> torch.Tensor:
        out = torch.empty(x.q.shape[0], x.q.shape[1] * x.q.shape[2], dtype=x.q.dtype, device=x.q.device)
        for plan in self.plans:
            for w in plan.writes:
                _write(x, plan, w)
        for plan in self.plans:
            segments = [view_segment(x.model, x.layer, view) for view in plan.views if view.end > view.start]
            out[plan.row.slice] = attend(x.q[plan.row.slice], plan.pos0, segments)
        return out


def commit_plans(plans: list[RowPlan]) -> None:
    """Advance each written store's length to the end of what the plans wrote."""
    for plan in plans:
        for w in plan.writes:
            w.store.commit(max(w.store.length, plan.end))


def run_plans(model, plans: list[RowPlan]) -> list[torch.Tensor | None]:
    """Run ``plans`` as one mixed-adapter batch; return each plan's last-token logits ``[vocab]`` (or None).

    Raises:
        ValueError: a plan has no tokens.
    """
    rows, start = [], 0
    for plan in plans:
        if not plan.token_ids:
            raise ValueError("a row plan needs at least one token")
        plan.row = Row(start, start + len(plan.token_ids), plan.adapter)
        rows.append(plan.row)
        start += len(plan.token_ids)
    ids = torch.tensor([t for p in plans for t in p.token_ids], device=model.device)
    positions = torch.cat([torch.arange(p.pos0, p.end, device=model.device) for p in plans])
    wanted = [i for i, p in enumerate(plans) if p.want_logits]
    logits = model.forward(
        ids, positions, rows, PlannedAttention(plans), logits_at=[rows[i].end - 1 for i in wanted]
    )
    commit_plans(plans)
    result: list[torch.Tensor | None] = [None] * len(plans)
    for j, i in enumerate(wanted):
        result[i] = logits[j]
    return result
