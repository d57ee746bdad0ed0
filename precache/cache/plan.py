"""Running row plans: :func:`run_plans` prepares the pool blocks (reserve, copy-on-write), runs the
model with :class:`~precache.cache.planned_attention.PlannedAttention` (the cache entries written
and the attention backend called at every layer) and commits the lengths once every layer has
written; :func:`blocks_needed` is what the scheduler admits rows by.

The records a sharing method builds live in :mod:`precache.cache.rowplan`, what a view reads in
:mod:`precache.cache.views`.
"""

from __future__ import annotations

import torch

from precache.cache.attention import AttentionBackend
from precache.cache.attention.torch_backend import TorchBackend
from precache.cache.planned_attention import PlannedAttention
from precache.cache.pool import PagedStore
from precache.cache.rowplan import RowPlan
from precache.cache.step_inputs import decode_step
from precache.errors import ContextLengthError
from precache.models.contract import Row


def reserve_writes(plans: list[RowPlan]) -> None:
    """Reserve and copy-on-write every written block before the forward (block ids may change).
    Idempotent: the scheduler reserves a request's rows when it takes them into a step, so nothing
    started later in the step (a prefix match attaching cached blocks) can take those blocks.

    Raises:
        OutOfBlocksError: the pool has no block left for the writes.
    """
    for plan in plans:
        for w in plan.writes:
            start = plan.write_start(w)
            if start < plan.end:
                w.paged.prepare_write(start, plan.end)


def blocks_needed(plans: list[RowPlan]) -> int:
    """New pool blocks running ``plans`` would take: blocks past each written store's table, plus
    shared blocks in a written range (copy-on-write). The scheduler admits rows while they fit."""
    spans: dict[PagedStore, tuple[int, int]] = {}  # written range per store
    for plan in plans:
        for w in plan.writes:
            start, store = plan.write_start(w), w.paged
            if start < plan.end:
                s0, e0 = spans.get(store, (start, plan.end))
                spans[store] = (min(s0, start), max(e0, plan.end))
    need = 0
    for store, (start, end) in spans.items():
        pool, off = store.pool, store.offset
        last = pool.blocks_for(end - off)
        need += max(0, last - len(store.blocks))
        shared = store.blocks[(start - off) // pool.block_size : last]
        need += sum(pool.allocator.is_shared(b) for b in shared)
    return need


def _commit(plans: list[RowPlan]) -> None:
    """Advance each written store's length to the end of what the plans wrote."""
    for plan in plans:
        for w in plan.writes:
            w.store.commit(max(w.store.length, plan.end))


def run_plans(
    model, plans: list[RowPlan], backend: AttentionBackend | None = None
) -> list[torch.Tensor | None]:
    """Run ``plans`` as one mixed-adapter batch; return each plan's last-token logits ``[vocab]`` (or None).

    ``backend`` defaults to the torch reference. Recompute rows
    (:class:`~precache.cache.rowplan.Recompute`) go after every other row in the batch, so
    narrowing them never moves a token whose logits are wanted.

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
    reserve_writes(batch)
    wanted = [j for j, p in enumerate(batch) if p.want_logits]
    captured = _captured_step(model, batch)
    logits = captured[wanted] if captured is not None else _eager_forward(model, batch, rows, wanted, backend)
    _commit(batch)
    result: list[torch.Tensor | None] = [None] * len(plans)
    for k, j in enumerate(wanted):
        result[order[j]] = logits[k]
    return result


def _captured_step(model, batch: list[RowPlan]) -> torch.Tensor | None:
    """Logits ``[B, vocab]`` of a decode step run as the model's captured graph
    (:mod:`precache.models.step_graph`), which writes its entries into the pool after it; None
    when the model has no graph or the graph does not run this batch (:func:`decode_step`)."""
    graph = getattr(model, "decode_graph", None)
    if graph is None:
        return None
    pool = next((w.paged.pool for p in batch for w in p.writes), None)
    step = decode_step(model, batch, pool) if pool is not None else None
    return graph(step) if step is not None else None


def _eager_forward(model, batch, rows, wanted, backend) -> torch.Tensor:
    ids = torch.tensor([t for p in batch for t in p.token_ids], device=model.device)
    positions = torch.cat([torch.arange(p.pos0, p.end) for p in batch]).to(model.device)  # one copy
    attention = PlannedAttention(model, batch, backend or TorchBackend())
    return model.forward(ids, positions, rows, attention, logits_at=[rows[j].end - 1 for j in wanted])
