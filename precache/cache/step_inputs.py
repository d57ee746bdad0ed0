"""A decode step's row plans as the model's captured step
(:class:`~precache.models.contract.DecodeStep`): its fixed tensors, the pool tensors it reads and
where its new entries go in the pool after it; the ``prepare`` of the compiled decode path
(issue 34).

Every sharing method's decode rows fit one description, so no method has code here: a row writes
base entries, full (adapted) entries and LR rows at some pool rows (its plan's writes), and reads
pool rows in position order, some of them with its adapter's LR part (its plan's views). The graph
reads the pool as it was before the step; the row's own key is the entry it writes, marked
``is_self``, so the graph takes it from what it just computed. :func:`decode_step` returns
None for a batch the graph does not run (a prefill or recompute row, a lone row over two pools,
LR reads of two adapters in one row, a LoRA bias), which then runs the eager forward.
"""

from __future__ import annotations

import torch

from precache.cache.pool import KVPool
from precache.cache.rowplan import BaseWrite, FullWrite, LRWrite, RowPlan
from precache.lora.adapter import LoRAAdapter
from precache.lora.targets import PROJECTIONS
from precache.models.contract import DecodeStep, DecodeStepInputs, StepWrites
from precache.models.step_attention import MAX_RUNS, VALUE_PAD

#: adapters a pool's stacks hold before they are rebuilt from one step's adapters only
MAX_STACKED = 16


class _Stacks:
    """A pool's LoRA stacks (:class:`DecodeStepInputs` ``stacks``): each adapter's ``A`` and
    ``s B`` of every projection and layer, zero-padded to the largest rank; index 0 is the base
    model. Rebuilt when a step brings an adapter it does not hold."""

    def __init__(self, adapters: list[LoRAAdapter], num_layers: int, dtype, device):
        self.adapters = adapters
        self.index = {id(a): i + 1 for i, a in enumerate(adapters)}
        self.rank = max((a.rank for a in adapters), default=0)
        self.tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for proj in PROJECTIONS:
            shapes = [
                (w[0].shape[0], w[1].shape[1])
                for a in adapters
                for (_, p), w in a.weights.items()
                if p == proj
            ]
            if not shapes:
                continue
            d_in, d_out = shapes[0]
            A = torch.zeros(len(adapters) + 1, num_layers, d_in, self.rank, dtype=dtype, device=device)
            Bs = torch.zeros(len(adapters) + 1, num_layers, self.rank, d_out, dtype=dtype, device=device)
            for j, a in enumerate(adapters, start=1):
                for layer in range(num_layers):
                    if a.has(layer, proj):
                        wa, wb = a.weights[(layer, proj)]
                        A[j, layer, :, : wa.shape[1]] = wa
                        Bs[j, layer, : wb.shape[0]] = wb * a.scaling
            self.tensors[proj] = (A, Bs)


def _stacks(pool: KVPool, adapters: list[LoRAAdapter], num_layers: int, dtype: torch.dtype) -> _Stacks:
    cache = pool.step_cache
    held: _Stacks | None = cache.get("stacks")
    if held is not None and all(id(a) in held.index for a in adapters):
        return held
    keep = [] if held is None else [a for a in held.adapters if id(a) not in {id(b) for b in adapters}]
    chosen = (keep + adapters) if len(keep) + len(adapters) <= MAX_STACKED else adapters
    cache["stacks"] = _Stacks(chosen, num_layers, dtype, pool.device)
    return cache["stacks"]


def _lr_down(
    pool: KVPool,
    writers: dict[int, tuple[slice, slice, LoRAAdapter]],
    num_layers: int,
    hidden: int,
    dtype: torch.dtype,
):
    """``[n_layers, hidden, C]``: each written agent's ``A^k`` / ``A^v`` at its columns, zeros
    elsewhere; built once per set of writers (kept on the pool)."""
    key = ("lr_down", tuple(sorted((s, id(a)) for s, (_, _, a) in writers.items())))
    hit = pool.step_cache.get(key)
    if hit is None:
        down = torch.zeros(num_layers, hidden, pool.lr_width, dtype=dtype, device=pool.device)
        for cols_k, cols_v, adapter in writers.values():
            for proj, cols in (("k_proj", cols_k), ("v_proj", cols_v)):
                for layer in range(num_layers):
                    if cols.stop > cols.start and adapter.has(layer, proj):
                        down[layer, :, cols] = adapter.weights[(layer, proj)][0]
        hit = pool.step_cache[key] = (tuple(a for _, _, a in writers.values()), down)
    return hit[1]


def _row_of(store, pos: int) -> int:
    ((_, _, row),) = store.runs(pos, pos + 1)
    return row


def decode_step(model, plans: list[RowPlan], pool: KVPool) -> DecodeStep | None:
    """The captured step of ``plans`` (one token each, in batch order, their written blocks already
    reserved): its inputs, the pool tensors it reads (``pool.k``, ``pool.v``, ``pool.lr``, or for
    window inputs (:class:`DecodeStepInputs`) tuples of their views over each run of rows) and its
    writes into the pool; None when the graph does not run them (module docstring)."""
    c = model.config
    if not plans or any(len(p.token_ids) != 1 or p.recompute is not None for p in plans):
        return None
    adapters: dict[int, LoRAAdapter] = {}
    rows = []
    writers: dict[int, tuple[slice, slice, LoRAAdapter]] = {}
    base_w, full_w, lr_w = [], [], []
    for b, plan in enumerate(plans):
        pos = plan.pos0
        for a in (
            [plan.adapter]
            + [v.adapter for v in plan.views]
            + [w.adapter for w in plan.writes if isinstance(w, LRWrite)]
        ):
            if a is not None:
                if a.biases:
                    return None
                adapters[id(a)] = a
        base = full = None
        lr_here: dict[int, list[slice]] = {}
        for w in plan.writes:
            if w.paged.pool is not pool or plan.write_start(w) > pos:
                if w.paged.pool is not pool:
                    return None
                continue
            row = _row_of(w.paged, pos)
            if isinstance(w, BaseWrite):
                base_w.append((b, row))
                base = row
            elif isinstance(w, FullWrite):
                full_w.append((b, row))
                full = row
            else:
                ck, cv = w.store.cols_k, w.store.cols_v
                if writers.setdefault(ck.start, (ck, cv, w.adapter))[2] is not w.adapter:
                    return None  # two adapters for one column range
                lr_here.setdefault(row, []).extend([ck, cv])
        for row, cols in lr_here.items():
            lr_w.append((b, row, cols))
        # reads: pool rows in position order, the LR part where a view carries one
        slots, positions, lr_flags = [], [], []
        lr_read = None
        for view in plan.views:
            if view.end <= view.start:
                continue
            if view.store.pool is not pool:
                return None
            with_lr = view.lr is not None and view.adapter is not None
            if with_lr:
                key = (id(view.adapter), view.lr.cols_k.start, view.lr.cols_v.start)
                if lr_read is not None and lr_read[0] != key:
                    return None
                lr_read = (key, view.adapter, view.lr)
            for s, e, r in view.store.runs(view.start, view.end):
                slots.append(torch.arange(r, r + e - s))
                positions.append(torch.arange(s, e))
                lr_flags.append(torch.full((e - s,), with_lr))
        if not slots:
            return None
        slot_t, pos_t, lr_t = torch.cat(slots), torch.cat(positions), torch.cat(lr_flags)
        where = (pos_t == pos).nonzero()
        if where.numel() != 1:
            return None  # the row does not see its own token exactly once
        col = int(where[0, 0])
        own = int(slot_t[col])
        if own not in (base, full):
            return None
        if bool(lr_t[col]):
            written = lr_here.get(own, [])
            read_cols = (lr_read[2].cols_k, lr_read[2].cols_v)
            if any(not any(rc == wc for wc in written) for rc in read_cols if rc.stop > rc.start):
                return None
        rows.append((plan, slot_t, pos_t, lr_t, col, own == full and own != base, lr_read))
    stacks = _stacks(pool, list(adapters.values()), c.num_layers, model.dtype)
    return _tensors(model, pool, rows, stacks, writers, base_w, full_w, lr_w)


def _window(slot_t: torch.Tensor, col: int) -> tuple[list[slice], torch.Tensor] | None:
    """``(runs, order)`` when a row's keys other than key ``col`` (its own) are at most
    :data:`MAX_RUNS` runs of contiguous pool rows, each of two rows or more (a dynamic dimension
    is never 1): ``runs`` the pool rows of each, ascending, ``order`` ``[n]`` the keys in run order
    with the own key last; None otherwise."""
    n = slot_t.shape[0]
    keys = torch.cat([torch.arange(col), torch.arange(col + 1, n)])
    others, by_row = slot_t[keys].sort()
    if others.numel() < 2:
        return None
    breaks = ((others[1:] - others[:-1]) != 1).nonzero().flatten().tolist()
    if len(breaks) >= MAX_RUNS:
        return None
    bounds = [0, *(b + 1 for b in breaks), others.numel()]
    if any(e - s < 2 for s, e in zip(bounds, bounds[1:], strict=False)):
        return None
    runs = [slice(int(others[s]), int(others[e - 1]) + 1) for s, e in zip(bounds, bounds[1:], strict=False)]
    return runs, torch.cat([keys[by_row], torch.tensor([col])])


def _tensors(model, pool, rows, stacks: _Stacks, writers, base_w, full_w, lr_w):
    B = len(rows)
    window = _window(rows[0][1], rows[0][4]) if B == 1 and pool.device.type == "cpu" else None
    if window is not None:  # the keys in run order, the own key last (DecodeStepInputs.window)
        runs, order = window
        plan, slot_t, pos_t, lr_t, _, own_full, lr_read = rows[0]
        rows = [(plan, slot_t[order], pos_t[order], lr_t[order], len(order) - 1, own_full, lr_read)]
    L = max(2, *(r[1].shape[0] for r in rows))  # a dynamic dimension is never 1
    R = stacks.rank
    reads_lr = any(r[6] is not None for r in rows)
    c = model.config
    slots = torch.empty(B, L, dtype=torch.long)
    key_pos = torch.zeros(B, L, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    is_self = torch.zeros(B, L, dtype=torch.bool)
    lr_on = torch.zeros(B, L, dtype=torch.bool)
    lr_cols = torch.zeros(B, 2 * R if reads_lr else 0, dtype=torch.long)
    lr_adapter = torch.zeros(B, dtype=torch.long)
    adapter = torch.zeros(B, dtype=torch.long)
    self_full = torch.zeros(B, dtype=torch.bool)
    for b, (plan, slot_t, pos_t, lr_t, col, own_full, lr_read) in enumerate(rows):
        n = slot_t.shape[0]
        slots[b, :n], slots[b, n:] = slot_t, slot_t[0]  # padding reads a written row: finite values
        key_pos[b, :n], valid[b, :n], lr_on[b, :n] = pos_t, True, lr_t
        is_self[b, col] = True
        self_full[b] = own_full
        adapter[b] = stacks.index[id(plan.adapter)] if plan.adapter is not None else 0
        if lr_read is not None:
            _, a, view = lr_read
            lr_adapter[b] = stacks.index[id(a)]
            ck, cv = view.cols_k, view.cols_v
            lr_cols[b, : ck.stop - ck.start] = torch.arange(ck.start, ck.stop)
            lr_cols[b, R : R + cv.stop - cv.start] = torch.arange(cv.start, cv.stop)
    lr_down = _lr_down(pool, writers, c.num_layers, c.hidden_size, model.dtype) if writers else None
    if reads_lr and lr_down is None:  # the graph overlays the own key's LR part from the new rows
        lr_down = torch.zeros(c.num_layers, c.hidden_size, pool.lr_width, dtype=model.dtype)
    device = pool.device

    def pairs(ws):
        src = torch.tensor([w[0] for w in ws], dtype=torch.long, device=device)
        return src, torch.tensor([w[1] for w in ws], dtype=torch.long, device=device)

    passes: list[list] = []
    for write in lr_w:  # each pool row at most once per pass
        free = next((p for p in passes if all(w[1] != write[1] for w in p)), None)
        if free is None:
            passes.append(free := [])
        free.append(write)
    lr_passes = []
    for ws in passes:
        mask = torch.zeros(len(ws), pool.lr_width, dtype=torch.bool)
        for j, (_, _, cols) in enumerate(ws):
            for s in cols:
                mask[j, s] = True
        lr_passes.append((*pairs(ws), mask.to(device)))

    ids = torch.tensor([p.token_ids[0] for p, *_ in rows], dtype=torch.long)
    positions = torch.tensor([p.pos0 for p, *_ in rows], dtype=torch.long)
    inputs = DecodeStepInputs(
        ids.to(device),
        positions.to(device),
        adapter.to(device),
        self_full.to(device),
        slots.to(device),
        key_pos.to(device),
        valid.to(device),
        is_self.to(device),
        lr_on.to(device),
        lr_cols.to(device),
        lr_adapter.to(device),
        stacks.tensors,
        lr_down,
        window is not None,
    )
    writes = StepWrites(*pairs(base_w), *pairs(full_w), tuple(lr_passes))
    tensors = (pool.k, pool.v, pool.lr)
    if window is None:
        return DecodeStep(inputs, tensors, writes, tensors)
    k_runs, lr_runs = (tuple(t[:, run] for run in runs) for t in (pool.k, pool.lr))
    return DecodeStep(inputs, (k_runs, tuple(_padded(pool.v, run) for run in runs), lr_runs), writes, tensors)


def _padded(t: torch.Tensor, run: slice) -> torch.Tensor:
    """The pool rows ``run`` of ``t`` and :data:`VALUE_PAD` rows past them (the next rows of the
    layer, or past the last layer the pool's spare rows: :class:`KVPool`), read at weight 0."""
    size = (t.shape[0], run.stop - run.start + VALUE_PAD, *t.shape[2:])
    return t.as_strided(size, t.stride(), t.storage_offset() + run.start * t.stride(1))
