"""PreLRShared (PReCache): when a token is first processed by its author j, write the base from
``h^j`` and the LR caches of ALL agents as ``h^j A_a`` in the same forward (DESIGN.md fact 4).
Every later turn prefills only new tokens; memory is one base plus N rank-r LR caches.
"""

from __future__ import annotations

from precache.cache.rowplan import BaseWrite, RowPlan, View
from precache.methods.base import SplitKVMethod


class PreLRShared(SplitKVMethod):
    name = "prelrshared"

    def plans(self, state, agent, token_ids, pos0):
        end = pos0 + len(token_ids)
        writes = [BaseWrite(state.base), *self.lr_writes(state, self.adapters)]
        lr = state.lr.get(agent) if agent is not None else None
        view = View(state.base, 0, end, lr, self.adapter(agent))
        return [RowPlan(token_ids, pos0, self.adapter(agent), writes, [view])]
