"""Row plans: which cache entries a forward writes from which hidden states, and what each row reads.

A sharing method turns "agent c processes these tokens" into one or more :class:`RowPlan` s;
:func:`run_plans` prepares the pool blocks (reserve, copy-on-write), builds the attention metadata
once, and runs the model with :class:`PlannedAttention`, which at every layer writes the entries
and calls the attention backend over the whole batch. Writes happen before attention, so new
tokens see themselves; lengths are committed once every layer has written.

Selective recomputation (CacheBlend, DroidSpeak, RelayCaching) is a row with a :class:`Recompute`:
tokens that already have cache entries run again with the row's adapter, writing only at some
layers, and the row narrows at a layer boundary to the tokens a selection keeps (the model carries
only those through the later layers, :class:`~precache.models.contract.Narrowing`). A narrowed
row's tokens sit at scattered positions; attention runs one query piece per run of consecutive
positions, each reading the row's views up to the end of its run (causal), so every backend runs
it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from precache.cache.attention import DECODE_MAX, AttentionBackend, BatchMetadata, KVRead, RowAttention
from precache.cache.attention.torch_backend import TorchBackend, segment_at
from precache.cache.pool import KVPool, LRView, PagedStore
from precache.errors import ContextLengthError
from precache.lora.adapter import LoRAAdapter
from precache.models.contract import LayerInput, Narrowing, Row


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
    writes: list[BaseWrite | FullWrite | LRWrite]
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


#: a row's tokens as runs of consecutive positions: ``(first position, end position, batch row of
#: the first)``; one run over the whole row until a :class:`Recompute` narrows it
Layout = list[tuple[int, int, int]]


class PlannedAttention:
    """The :class:`~precache.models.contract.AttentionBackend` that writes the plans' cache entries
    at each layer, then runs the attention ``backend`` over every row at once.

    Rows with a :class:`Recompute` are narrowed at their layer boundaries (:meth:`narrow`); the
    write groups and the attention metadata are rebuilt when the batch layout or the set of
    writing rows changes (a few times per forward at most)."""

    def __init__(self, model, plans: list[RowPlan], backend: AttentionBackend):
        self.model, self.plans, self.backend = model, plans, backend
        self.layouts: list[Layout] = [[(p.pos0, p.end, p.row.start)] for p in plans]
        self.meta = _metadata(model, plans, self.layouts)
        self.writes: list[_WriteGroup] = []
        self._recompute = [i for i, p in enumerate(plans) if p.recompute is not None]
        self._writing: tuple | None = None
        self._selected: dict[int, torch.Tensor] = {}

    def attend(self, x: LayerInput) -> torch.Tensor:
        layer = x.layer
        writing = tuple(layer >= self.plans[i].recompute.first_write for i in self._recompute)
        if writing != self._writing:
            idle = {i for i, on in zip(self._recompute, writing, strict=True) if not on}
            self.writes, self._writing = _write_groups(self.plans, self.layouts, idle), writing
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
        self.meta = _metadata(self.model, self.plans, layouts)
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


def _reserve(plans: list[RowPlan]) -> None:
    """Reserve and copy-on-write every written block before the forward (block ids may change)."""
    for plan in plans:
        for w in plan.writes:
            start = _write_start(plan, w)
            if start < plan.end:
                _paged(w).prepare_write(start, plan.end)


def _write_groups(plans: list[RowPlan], layouts: list[Layout], idle: set[int]) -> list[_WriteGroup]:
    """Resolve the writes of every row but the ``idle`` ones (recompute rows that write nothing at
    this layer) to pool rows and merge the writes of one kind (one pool, one adapter) across rows."""
    groups: dict[tuple, tuple[RowPlan, object, list, list]] = {}
    for i, (plan, runs) in enumerate(zip(plans, layouts, strict=True)):
        if i in idle:
            continue
        for w in plan.writes:
            start = _write_start(plan, w)
            for s, e, b in runs:
                first = max(s, start)
                if first < e:
                    entry = groups.setdefault(_group_key(plan, w), (plan, w, [], []))
                    entry[2].append((b + first - s, b + e - s))
                    entry[3].extend((row, row + stop - p) for p, stop, row in _paged(w).runs(first, e))
    out = []
    for key, (plan, w, src, dst) in groups.items():
        pool = _paged(w).pool
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

    ``backend`` defaults to the torch reference. Recompute rows (:class:`Recompute`) go after every
    other row in the batch, so narrowing them never moves a token whose logits are wanted.

    Raises:
        ValueError: a plan has no tokens, or a recompute row asks for logits.
        OutOfBlocksError: the pool has no block left for the writes (nothing was committed).
    """
    for plan in plans:
        if not plan.token_ids:
            raise ValueError("a row plan needs at least one token")
        if plan.recompute is not None and plan.want_logits:
            raise ValueError("a recompute row carries no logits (want_logits=False)")
    order = sorted(range(len(plans)), key=lambda i: plans[i].recompute is not None)  # stable
    batch = [plans[i] for i in order]
    rows, start = [], 0
    for plan in batch:
        plan.row = Row(start, start + len(plan.token_ids), plan.adapter)
        rows.append(plan.row)
        start += len(plan.token_ids)
    last = max((p.end for p in batch), default=0) - 1  # checked here, on the host: no device sync
    if last >= model.max_context:
        raise ContextLengthError(f"position {last} is past the context length {model.max_context}")
    _reserve(batch)
    ids = torch.tensor([t for p in batch for t in p.token_ids], device=model.device)
    positions = torch.cat([torch.arange(p.pos0, p.end) for p in batch]).to(model.device)  # one copy
    wanted = [j for j, p in enumerate(batch) if p.want_logits]
    attention = PlannedAttention(model, batch, backend or TorchBackend())
    logits = model.forward(ids, positions, rows, attention, logits_at=[rows[j].end - 1 for j in wanted])
    commit_plans(batch)
    result: list[torch.Tensor | None] = [None] * len(plans)
    for k, j in enumerate(wanted):
        result[order[j]] = logits[k]
    return result
