"""BaseShared (LRAgent, arXiv 2602.01053): one base cache from whoever read a token first, and
per-agent LR caches that each agent fills from its own hidden states by re-reading what it has
not seen. Its prefill cost is therefore NonShared's; it saves memory, not compute.
"""

from __future__ import annotations

from precache.cache.pool import LRView
from precache.cache.rowplan import BaseWrite, LRWrite, RowPlan, View
from precache.errors import CacheIntegrityError
from precache.methods.split import SplitKVMethod
from precache.methods.state import CacheState


class BaseShared(SplitKVMethod):
    """An agent's LR rows exist only where that agent has read, so no block is complete for every
    agent: BaseShared shares blocks with forks, never with other trajectories by prefix."""

    name = "baseshared"

    def prefix_stores(self, state: CacheState):
        return {}

    def reuse_key(self, state: CacheState, agent: str | None) -> str | None:
        return None

    def add_agent_cache(self, state: CacheState, agent: str) -> None:
        state.lr[agent] = LRView(state.base, agent)  # it reads from token 0 at its turn, as any agent

    def prefill_start(self, state: CacheState, agent: str | None) -> int:
        return state.base.length if agent is None else state.lr[agent].length

    def plans(self, state, agent, token_ids, pos0):
        end = pos0 + len(token_ids)
        # an existing base entry is kept: only tokens nobody has read get their base from h^c
        writes = [BaseWrite(state.base, skip=max(0, state.base.length - pos0))]
        if agent is None:
            return [RowPlan(token_ids, pos0, None, writes, [View(state.base, 0, end)])]
        adapter = self.adapters[agent]
        writes.append(LRWrite(state.lr[agent], adapter))
        return [
            RowPlan(token_ids, pos0, adapter, writes, [View(state.base, 0, end, state.lr[agent], adapter)])
        ]

    def check(self, state: CacheState) -> None:
        for a, store in state.lr.items():
            if store.length > state.base.length:
                raise CacheIntegrityError(f"baseshared: LR cache of '{a}' ({store.length}) outruns the base")
