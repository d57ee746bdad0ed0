"""ReBaseShared (PReCache): the base cache comes from the adapter-free (neutral) forward over the
whole trajectory; an agent's LR cache holds ``h^j A_j`` over its own segments and ``h^0 A_a``
elsewhere (DESIGN.md facts 3 and 5).

During its turn the current agent reads its exact adapted K/V for the turn's tokens (a turn-local
full cache); the neutral pass that extends the base runs either after the turn (``schedule="lp"``,
lazy prefill, outside the next agent's TTFT) or as a second row of every forward of the turn
(``schedule="db"``, double batching).
"""

from __future__ import annotations

from precache.cache.rowplan import BaseWrite, FullWrite, LRWrite, RowPlan, View
from precache.methods.split import SplitKVMethod
from precache.methods.state import CacheState

SCHEDULES = ("lp", "db")


class ReBaseShared(SplitKVMethod):
    """``schedule``: ``"lp"`` (lazy prefill) or ``"db"`` (double batching); the method's name is
    ``f"{family}-{schedule}"``.

    Raises:
        ValueError: ``schedule`` is not one of :data:`SCHEDULES`.
    """

    family = "rebaseshared"

    def __init__(self, model, adapters, pool, schedule: str = "lp", **options):
        if schedule not in SCHEDULES:
            raise ValueError(f"{type(self).__name__} schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.schedule = schedule
        self.name = f"{self.family}-{schedule}"
        super().__init__(model, adapters, pool, **options)

    def cached_length(self, state: CacheState) -> int:
        return state.base.length if state.turn is None else state.turn_start

    def extra_turn_blocks(self, turn_tokens: int) -> int:
        return self.pool.blocks_for(turn_tokens) + 1  # the turn-local full cache (it may start mid-block)

    def prefix_stores(self, state: CacheState):
        return {} if state.turn is not None else super().prefix_stores(state)

    def begin_turn(self, state: CacheState, agent: str | None) -> None:
        super().begin_turn(state, agent)
        state.turn = self.new_kv_store(offset=state.turn_start)

    def _neutral_plan(self, state: CacheState, agent, token_ids, pos0) -> RowPlan:
        others = [a for a in self.adapters if a != agent]
        writes = [BaseWrite(state.base), *self.lr_writes(state, others)]
        end = pos0 + len(token_ids)
        return RowPlan(token_ids, pos0, None, writes, [View(state.base, 0, end)], want_logits=False)

    def earlier_views(self, state: CacheState, agent: str | None, end: int) -> list[View]:
        """What ``agent`` reads over the earlier segments ``[0, end)``, in position order: the neutral
        base plus its LR part everywhere (its own segments included)."""
        lr = state.lr.get(agent) if agent is not None else None
        return [View(state.base, 0, end, lr, self.adapter(agent))]

    def plans(self, state, agent, token_ids, pos0):
        t0, end = state.turn_start, pos0 + len(token_ids)
        adapter = self.adapter(agent)
        writes: list = [FullWrite(state.turn)]
        if adapter is not None:
            writes.append(LRWrite(state.lr[agent], adapter))
        views = [*self.earlier_views(state, agent, t0), View(state.turn, t0, end)]
        adapted = RowPlan(token_ids, pos0, adapter, writes, views)
        if self.schedule == "db":
            return [adapted, self._neutral_plan(state, agent, token_ids, pos0)]
        return [adapted]

    def catch_up(self, state: CacheState, agent, token_ids, authors):
        """An agent added at run time has no segment of its own yet, so its LR cache is
        ``h^0 A_a`` over the whole trajectory (DESIGN.md fact 5): one neutral row over the gap,
        reading the base it wrote, writes it."""
        if agent is None or agent not in state.late:
            return []
        state.late.discard(agent)
        start, end = state.lr[agent].length, state.base.length
        if start >= end:
            return []
        write = LRWrite(state.lr[agent], self.adapters[agent])
        view = View(state.base, 0, end)
        return [RowPlan(token_ids[start:end], start, None, [write], [view], want_logits=False)]

    def close_turn_cache(self, state: CacheState, agent: str | None) -> None:
        """What becomes of the turn's exact adapted K/V (``state.turn``) when the turn ends: dropped."""
        state.turn.release()

    def end_turn(self, state: CacheState, agent: str | None, trajectory: list[int]) -> list[RowPlan]:
        t0, end = state.turn_start, state.turn.length
        self.close_turn_cache(state, agent)
        state.turn = None
        super().end_turn(state, agent, trajectory)
        if self.schedule == "lp" and end > t0:
            return [self._neutral_plan(state, agent, trajectory[t0:end], t0)]
        return []
