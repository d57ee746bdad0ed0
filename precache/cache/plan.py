"""Row plans: which cache entries a forward writes from which hidden states, and what each row reads.

A sharing method turns "agent c processes these tokens" into one or more :class:`RowPlan` s;
:func:`run_plans` prepares the pool blocks (reserve, copy-on-write), builds the attention metadata
once, and runs the model with :class:`PlannedAttention`, which at every layer writes the entries
and calls the attention backend over the whole batch. Writes happen before attention, so new
tokens see themselves; lengths are committed once every layer has written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from precache.cache.attention import DECODE_MAX, AttentionBackend, BatchMetadata, KVRead, RowAttention
from precache.cache.attention.torch_backend import TorchBackend, segment_at
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


@dataclass(frozen=True)
class FullWrite:
    """Full KV-cache entries with the row's own adapter (NonShared, FullShared, a turn's own tokens)."""

    store: PagedStore


@dataclass(frozen=True)
class LRWrite:
    """LR cache entries ``h A_a^k``, ``h A_a^v`` of ``adapter`` from the row's hidden states."""

    store: LRView
    adapter: LoRAAdapter


@dataclass(frozen=True)
class View:
    """Keys/values of ``store`` at positions ``[start, end)``, plus ``adapter``'s LR part from ``lr``
    (an :class:`LRView` of the same store's blocks)."""

    store: PagedStore
    start: int
    end: int
    lr: LRView | None = None
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


def _paged(w: BaseWrite | FullWrite | LRWrite) -> PagedStore:
    return w.store.store if isinstance(w, LRWrite) else w.store


def _write_start(plan: RowPlan, w) -> int:
    return plan.pos0 + (w.skip if isinstance(w, BaseWrite) else 0)


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
            cos, sin = model.rope.tables(torch.arange(start, end, device=model.device))
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


def lr_entries(
    x: LayerInput, sl: slice, adapter: LoRAAdapter
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(h A^k [T, r], h A^v [T, r])`` of tokens ``sl``; None where the adapter skips k or v."""
    h, layer = x.h[sl], x.layer
    lk = adapter.down(h, layer, "k_proj") if adapter.has(layer, "k_proj") else None
    lv = adapter.down(h, layer, "v_proj") if adapter.has(layer, "v_proj") else None
    return lk, lv


@dataclass(frozen=True)
class _WriteSpec:
    """A write resolved to pool rows: batch rows ``src`` of the layer input go to pool rows ``dst``."""

    write: BaseWrite | FullWrite | LRWrite
    plan: RowPlan
    src: slice
    dst: slice | torch.Tensor


class PlannedAttention:
    """The :class:`~precache.models.contract.AttentionBackend` that writes the plans' cache entries
    at each layer, then runs the attention ``backend`` over every row at once."""

    def __init__(self, writes: list[_WriteSpec], meta: BatchMetadata, backend: AttentionBackend):
        self.writes, self.meta, self.backend = writes, meta, backend

    def attend(self, x: LayerInput) -> torch.Tensor:
        layer = x.layer
        for spec in self.writes:
            w, pool = spec.write, _paged(spec.write).pool
            if isinstance(w, LRWrite):
                lk, lv = lr_entries(x, spec.src, w.adapter)
                if lk is not None:
                    pool.lr[layer][spec.dst, w.store.cols_k] = lk
                if lv is not None:
                    pool.lr[layer][spec.dst, w.store.cols_v] = lv
                continue
            if isinstance(w, BaseWrite):
                k, v = x.base_kv()
                k, v = k[spec.src], v[spec.src]
            else:
                k, v = x.adapted_kv(spec.src, spec.plan.adapter)
            pool.k[layer][spec.dst] = k
            pool.v[layer][spec.dst] = v
        return self.backend.forward(x.q, layer, self.meta, x.model)


def _prepare(plans: list[RowPlan]) -> list[_WriteSpec]:
    """Reserve and copy-on-write every written block first (block ids may change), then resolve rows."""
    for plan in plans:
        for w in plan.writes:
            start = _write_start(plan, w)
            if start < plan.end:
                _paged(w).prepare_write(start, plan.end)
    specs = []
    for plan in plans:
        for w in plan.writes:
            start = _write_start(plan, w)
            if start < plan.end:
                src = slice(plan.row.start + start - plan.pos0, plan.row.end)
                specs.append(_WriteSpec(w, plan, src, _paged(w).rows(start, plan.end)))
    return specs


def _metadata(model, plans: list[RowPlan], num_tokens: int) -> BatchMetadata:
    rows = []
    windows = model.config.layer_windows  # sliding windows per layer (Mistral, Qwen2/3)
    window = windows if any(w is not None for w in windows) else None
    for plan in plans:
        split = len(plan.token_ids) <= DECODE_MAX
        reads = tuple(r for view in plan.views for r in view_reads(model, view, split))
        rows.append(RowAttention(plan.row.slice, plan.pos0, reads, window))
    return BatchMetadata(tuple(rows), num_tokens)


def blocks_needed(plans: list[RowPlan]) -> int:
    """New pool blocks running ``plans`` would take: blocks past each written store's table, plus
    shared blocks in a written range (copy-on-write). The scheduler admits rows while they fit."""
    spans: dict[int, tuple[PagedStore, int, int]] = {}
    for plan in plans:
        for w in plan.writes:
            start, store = _write_start(plan, w), _paged(w)
            if start < plan.end:
                s0, e0 = spans.get(id(store), (store, start, plan.end))[1:]
                spans[id(store)] = (store, min(s0, start), max(e0, plan.end))
    need = 0
    for store, start, end in spans.values():
        pool, off = store.pool, store.offset
        last = pool.blocks_for(end - off)
        need += max(0, last - len(store.blocks))
        shared = store.blocks[(start - off) // pool.block_size : last]
        need += sum(pool.allocator.is_shared(b) for b in shared)
    return need


def commit_plans(plans: list[RowPlan]) -> None:
    """Advance each written store's length to the end of what the plans wrote."""
    for plan in plans:
        for w in plan.writes:
            w.store.commit(max(w.store.length, plan.end))


def run_plans(
    model, plans: list[RowPlan], backend: AttentionBackend | None = None
) -> list[torch.Tensor | None]:
    """Run ``plans`` as one mixed-adapter batch; return each plan's last-token logits ``[vocab]`` (or None).

    ``backend`` defaults to the torch reference.

    Raises:
        ValueError: a plan has no tokens.
        OutOfBlocksError: the pool has no block left for the writes (nothing was committed).
    """
    rows, start = [], 0
    for plan in plans:
        if not plan.token_ids:
            raise ValueError("a row plan needs at least one token")
        plan.row = Row(start, start + len(plan.token_ids), plan.adapter)
        rows.append(plan.row)
        start += len(plan.token_ids)
    writes = _prepare(plans)
    meta = _metadata(model, plans, start)
    ids = torch.tensor([t for p in plans for t in p.token_ids], device=model.device)
    positions = torch.cat([torch.arange(p.pos0, p.end, device=model.device) for p in plans])
    wanted = [i for i, p in enumerate(plans) if p.want_logits]
    attention = PlannedAttention(writes, meta, backend or TorchBackend())
    logits = model.forward(ids, positions, rows, attention, logits_at=[rows[i].end - 1 for i in wanted])
    commit_plans(plans)
    result: list[torch.Tensor | None] = [None] * len(plans)
    for j, i in enumerate(wanted):
        result[i] = logits[j]
    return result
