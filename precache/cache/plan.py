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
from precache.cache.pool import KVPool, LRView, PagedStore
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


def lr_entries(
    x: LayerInput, sl: slice, adapter: LoRAAdapter
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(h A^k [T, r], h A^v [T, r])`` of tokens ``sl``; None where the adapter skips k or v."""
    h, layer = x.h[sl], x.layer
    lk = adapter.down(h, layer, "k_proj") if adapter.has(layer, "k_proj") else None
    lv = adapter.down(h, layer, "v_proj") if adapter.has(layer, "v_proj") else None
    return lk, lv


@dataclass(frozen=True)
class _WriteGroup:
    """Writes of one kind merged over every row of the forward and resolved to pool rows: batch rows
    ``src`` of the layer input go to rows ``dst`` of ``pool`` (slices for a single contiguous piece,
    else index tensors on the device). ``kind``: ``"base"`` (adapter-free K/V), ``"full"``
    (``adapter``'s own K/V) or ``"lr"`` (``h A^k``, ``h A^v`` of ``adapter`` into columns ``cols``).
    One group costs a few ops per layer however many rows it covers."""

    kind: str
    pool: KVPool
    src: slice | torch.Tensor
    dst: slice | torch.Tensor
    adapter: LoRAAdapter | None = None
    cols: tuple[slice, slice] | None = None


class PlannedAttention:
    """The :class:`~precache.models.contract.AttentionBackend` that writes the plans' cache entries
    at each layer, then runs the attention ``backend`` over every row at once."""

    def __init__(self, writes: list[_WriteGroup], meta: BatchMetadata, backend: AttentionBackend):
        self.writes, self.meta, self.backend = writes, meta, backend

    def attend(self, x: LayerInput) -> torch.Tensor:
        layer = x.layer
        for g in self.writes:
            if g.kind == "lr":
                lk, lv = lr_entries(x, g.src, g.adapter)
                if lk is not None:
                    g.pool.lr[layer][g.dst, g.cols[0]] = lk
                if lv is not None:
                    g.pool.lr[layer][g.dst, g.cols[1]] = lv
                continue
            if g.kind == "base":
                k, v = x.base_kv()
                k, v = k[g.src], v[g.src]
            else:
                k, v = x.adapted_kv(g.src, g.adapter)
            g.pool.k[layer][g.dst] = k
            g.pool.v[layer][g.dst] = v
        return self.backend.forward(x.q, layer, self.meta, x.model)


def _group_key(plan: RowPlan, w) -> tuple:
    pool = _paged(w).pool
    if isinstance(w, LRWrite):
        return ("lr", id(pool), id(w.adapter), w.store.cols_k.start, w.store.cols_v.start)
    if isinstance(w, BaseWrite):
        return ("base", id(pool))
    return ("full", id(pool), id(plan.adapter))


def _merged(pieces: list[tuple[int, int]], device) -> slice | torch.Tensor:
    """Index ranges ``[start, stop)`` as one slice, or one index tensor built on the host and
    copied to ``device`` once (never read back)."""
    if len(pieces) == 1:
        return slice(*pieces[0])
    return torch.cat([torch.arange(a, b) for a, b in pieces]).to(device)


def _prepare(plans: list[RowPlan]) -> list[_WriteGroup]:
    """Reserve and copy-on-write every written block first (block ids may change), then resolve
    rows and merge the writes of one kind (one pool, one adapter) across rows."""
    for plan in plans:
        for w in plan.writes:
            start = _write_start(plan, w)
            if start < plan.end:
                _paged(w).prepare_write(start, plan.end)
    groups: dict[tuple, tuple[RowPlan, object, list, list]] = {}
    for plan in plans:
        for w in plan.writes:
            start = _write_start(plan, w)
            if start < plan.end:
                entry = groups.setdefault(_group_key(plan, w), (plan, w, [], []))
                entry[2].append((plan.row.start + start - plan.pos0, plan.row.end))
                entry[3].extend((row, row + e - s) for s, e, row in _paged(w).runs(start, plan.end))
    out = []
    for key, (plan, w, src, dst) in groups.items():
        pool = _paged(w).pool
        adapter = w.adapter if isinstance(w, LRWrite) else plan.adapter
        cols = (w.store.cols_k, w.store.cols_v) if isinstance(w, LRWrite) else None
        out.append(
            _WriteGroup(key[0], pool, _merged(src, pool.device), _merged(dst, pool.device), adapter, cols)
        )
    return out


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
    positions = torch.cat([torch.arange(p.pos0, p.end) for p in plans]).to(model.device)  # one copy
    wanted = [i for i, p in enumerate(plans) if p.want_logits]
    attention = PlannedAttention(writes, meta, backend or TorchBackend())
    logits = model.forward(ids, positions, rows, attention, logits_at=[rows[i].end - 1 for i in wanted])
    commit_plans(plans)
    result: list[torch.Tensor | None] = [None] * len(plans)
    for j, i in enumerate(wanted):
        result[i] = logits[j]
    return result
