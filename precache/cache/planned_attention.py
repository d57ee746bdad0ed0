"""The per-layer runtime of a forward over row plans: :class:`PlannedAttention` writes the plans'
cache entries at every layer, then calls the attention backend over the whole batch. Writes happen
before attention, so new tokens see themselves.

A row with a :class:`~precache.cache.rowplan.Recompute` narrows at a layer boundary to the tokens
a selection keeps (the model carries only those through the later layers,
:class:`~precache.models.contract.Narrowing`). A narrowed row's tokens sit at scattered positions;
attention runs one query piece per run of consecutive positions, each reading the row's views up
to the end of its run (causal), so every backend runs it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from precache.cache.attention import DECODE_MAX, AttentionBackend, BatchMetadata, RowAttention
from precache.cache.pool import KVPool
from precache.cache.rowplan import BaseWrite, LRWrite, RowPlan, View, Write
from precache.cache.views import view_reads
from precache.lora.adapter import LoRAAdapter
from precache.models.contract import LayerInput, Narrowing, Row


def _lr_entries(
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
    #: ``"lr_all"``: every agent's ``(adapter, cols)`` written from the same rows, whose columns
    #: tile one range (``cols[0]``): one product with the agents' ``A`` side by side, one write
    fused: tuple[tuple[LoRAAdapter, tuple[slice, slice]], ...] = ()

    def down_all(self, layer: int, d_in: int) -> torch.Tensor:
        """``[A^k_1 A^v_1 A^k_2 ...]`` ``[d, sum of ranks]`` at ``layer``, in column order (zero
        columns where an adapter skips the layer), built once per adapter set and layer."""
        cache = self.pool.fused_lr_down
        key = (layer, tuple((id(a), c[0].start) for a, c in self.fused))
        hit = cache.get(key)  # the entry holds its adapters, so their ids are not reused meanwhile
        if hit is None:
            mats = []
            for adapter, (ck, cv) in self.fused:
                for proj, cols in (("k_proj", ck), ("v_proj", cv)):
                    width = cols.stop - cols.start
                    if not width:
                        continue
                    if adapter.has(layer, proj):
                        mats.append(adapter.weights[(layer, proj)][0])
                    else:  # not read at this layer (the backend checks ``has``): zeros
                        mats.append(adapter.weights[next(iter(adapter.weights))][0].new_zeros(d_in, width))
            hit = cache[key] = (tuple(a for a, _ in self.fused), torch.cat(mats, dim=1))
        return hit[1]


#: a row's tokens as runs of consecutive positions: ``(first position, end position, batch row of
#: the first)``; one run over the whole row until a :class:`~precache.cache.rowplan.Recompute` narrows it
Layout = list[tuple[int, int, int]]


class PlannedAttention:
    """The :class:`~precache.models.contract.LayerAttention` that writes the plans' cache entries
    at each layer, then runs the attention ``backend`` over every row at once.

    Rows with a :class:`~precache.cache.rowplan.Recompute` are narrowed at their layer boundaries
    (:meth:`narrow`); the write groups and the attention metadata (prepared by the backend for
    every layer, :meth:`~precache.cache.attention.AttentionBackend.prepare`) are rebuilt when the
    batch layout or the set of writing rows changes (a few times per forward at most)."""

    def __init__(self, model, plans: list[RowPlan], backend: AttentionBackend):
        self.model, self.plans, self.backend = model, plans, backend
        self.layouts: list[Layout] = [[(p.pos0, p.end, p.row.start)] for p in plans]
        self.meta = self._prepared_metadata()
        self.writes: list[_WriteGroup] = []
        self._recompute = [i for i, p in enumerate(plans) if p.recompute is not None]
        self._writing: tuple | None = None
        self._selected: dict[int, torch.Tensor] = {}

    def _prepared_metadata(self) -> BatchMetadata:
        """The attention metadata of the current layouts, prepared once by the backend for every
        layer up to the next narrowing."""
        meta = _metadata(self.model, self.plans, self.layouts)
        self.backend.prepare(meta, self.model)
        return meta

    def attend(self, x: LayerInput) -> torch.Tensor:
        layer = x.layer
        writing = tuple(layer >= self.plans[i].recompute.first_write for i in self._recompute)
        if writing != self._writing:
            idle = {i for i, on in zip(self._recompute, writing, strict=True) if not on}
            self.writes, self._writing = _write_groups(self.plans, self.layouts, idle), writing
        for g in self.writes:
            if g.kind == "lr_all":
                lr = g.pool.lr[layer]
                lr[g.dst, g.cols[0]] = (x.h[g.src] @ g.down_all(layer, x.h.shape[1])).to(lr.dtype)
                continue
            if g.kind == "lr":
                lk, lv = _lr_entries(x, g.src, g.adapter)
                lr = g.pool.lr[layer]
                if lk is not None:
                    lr[g.dst, g.cols[0]] = lk.to(lr.dtype)
                if lv is not None:
                    lr[g.dst, g.cols[1]] = lv.to(lr.dtype)
                continue
            if g.kind == "base":
                k, v = x.base_kv()
                k, v = k[g.src], v[g.src]
            else:
                k, v = x.adapted_kv(g.src, g.adapter)
            g.pool.k[layer][g.dst] = k.to(g.pool.k.dtype)  # rounded once to the kv_cache_dtype
            g.pool.v[layer][g.dst] = v.to(g.pool.v.dtype)
        for i in self._recompute:
            rc, runs = self.plans[i].recompute, self.layouts[i]
            if rc.select_layer == layer and runs:
                n = sum(e - s for s, e, _ in runs)
                rows = slice(runs[0][2], runs[0][2] + n)
                self._selected[i] = rc.select(x, rows, _positions(runs))
        return self.backend.forward(x.q, layer, self.meta, x.model)

    def narrow(self, layer: int) -> Narrowing | None:
        """After ``layer``: drop the tokens of recompute rows that stop here or that their
        selection left out; None when no row narrows.

        Raises:
            ValueError: a selection returned another number of tokens than its ``kept``.
        """
        rcs = [(i, self.plans[i].recompute) for i in self._recompute if self.layouts[i]]
        if not any(layer in (rc.select_layer, rc.end_layer) for _, rc in rcs):
            return None
        device = self.model.device
        keep, rows, layouts, start = [], [], [], 0
        for i, plan in enumerate(self.plans):
            runs, rc = self.layouts[i], plan.recompute
            positions = _positions(runs)
            b0 = runs[0][2] if runs else 0
            if rc is not None and runs and layer == rc.end_layer:
                positions = []
            elif rc is not None and runs and layer == rc.select_layer:
                chosen = self._selected.pop(i).sort().values
                if chosen.numel() != rc.kept:
                    raise ValueError(
                        f"a recompute selection kept {chosen.numel()} tokens, expected {rc.kept}"
                    )
                keep.append(chosen.to(device) + b0)
                positions = [positions[j] for j in chosen.tolist()]
            else:
                keep.append(torch.arange(b0, b0 + len(positions), device=device))
            layouts.append(_runs(positions, start))
            if positions:
                rows.append(Row(start, start + len(positions), plan.adapter))
            start += len(positions)
        self.layouts, self._writing = layouts, None
        if layer + 1 < self.model.config.num_layers:  # no layer reads the metadata after the last
            self.meta = self._prepared_metadata()
        index = torch.cat(keep) if keep else torch.empty(0, dtype=torch.long, device=device)
        return Narrowing(index, rows)


def _positions(runs: Layout) -> list[int]:
    return [p for s, e, _ in runs for p in range(s, e)]


def _runs(positions: list[int], batch_start: int) -> Layout:
    """Ascending ``positions`` at batch rows from ``batch_start`` on, as runs of consecutive positions."""
    out: Layout = []
    for j, p in enumerate(positions):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1, out[-1][2])
        else:
            out.append((p, p + 1, batch_start + j))
    return out


def _group_key(plan: RowPlan, w: Write) -> tuple:
    pool = w.paged.pool
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


def _write_groups(plans: list[RowPlan], layouts: list[Layout], idle: set[int]) -> list[_WriteGroup]:
    """Resolve the writes of every row but the ``idle`` ones (recompute rows that write nothing at
    this layer) to pool rows and merge the writes of one kind (one pool, one adapter) across rows."""
    groups: dict[tuple, tuple[RowPlan, object, list, list]] = {}
    for i, (plan, runs) in enumerate(zip(plans, layouts, strict=True)):
        if i in idle:
            continue
        for w in plan.writes:
            start = plan.write_start(w)
            for s, e, b in runs:
                first = max(s, start)
                if first < e:
                    entry = groups.setdefault(_group_key(plan, w), (plan, w, [], []))
                    entry[2].append((b + first - s, b + e - s))
                    entry[3].extend((row, row + stop - p) for p, stop, row in w.paged.runs(first, e))
    out = []
    fused: dict[tuple, list] = {}  # LR writes of several agents from the same rows to the same rows
    for key, (_plan, _w, src, dst) in groups.items():
        if key[0] == "lr":
            fused.setdefault((key[1], tuple(src), tuple(dst)), []).append(key)
    for (_, src, dst), keys in fused.items():
        writes = sorted((groups[k][1] for k in keys), key=lambda w: w.store.cols_k.start)
        spans = [(w.store.cols_k.start, w.store.cols_v.stop) for w in writes]
        if len(writes) < 2 or any(a[1] != b[0] for a, b in zip(spans, spans[1:], strict=False)):
            continue  # one agent, or columns that do not tile one range: written one by one
        pool = writes[0].paged.pool
        parts = tuple((w.adapter, (w.store.cols_k, w.store.cols_v)) for w in writes)
        cols = (slice(spans[0][0], spans[-1][1]), slice(0, 0))
        out.append(
            _WriteGroup(
                "lr_all",
                pool,
                _merged(list(src), pool.device),
                _merged(list(dst), pool.device),
                None,
                cols,
                parts,
            )
        )
        for k in keys:
            del groups[k]
    for key, (plan, w, src, dst) in groups.items():
        pool = w.paged.pool
        adapter = w.adapter if isinstance(w, LRWrite) else plan.adapter
        cols = (w.store.cols_k, w.store.cols_v) if isinstance(w, LRWrite) else None
        out.append(
            _WriteGroup(key[0], pool, _merged(src, pool.device), _merged(dst, pool.device), adapter, cols)
        )
    return out


def _metadata(model, plans: list[RowPlan], layouts: list[Layout]) -> BatchMetadata:
    """One :class:`RowAttention` per run of each row, reading the row's views up to the run's end."""
    rows = []
    windows = model.config.layer_windows  # sliding windows per layer (Mistral, Qwen2/3)
    window = windows if any(w is not None for w in windows) else None
    for plan, runs in zip(plans, layouts, strict=True):
        for s, e, b in runs:
            split = e - s <= DECODE_MAX
            views = [v if v.end <= e else View(v.store, v.start, e, v.lr, v.adapter) for v in plan.views]
            reads = tuple(r for view in views for r in view_reads(model, view, split))
            rows.append(RowAttention(slice(b, b + e - s), s, reads, window))
    return BatchMetadata(tuple(rows), sum(e - s for runs in layouts for s, e, _ in runs))
