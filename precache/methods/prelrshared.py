"""PreLRShared (PReCache): when a token is first processed by its author j, write the base from
``h^j`` and the LR caches of ALL agents as ``h^j A_a`` in the same forward (DESIGN.md fact 4).
Every later turn prefills only new tokens; memory is one base plus N rank-r LR caches.
"""

from __future__ import annotations

from precache.cache.rowplan import BaseWrite, LRWrite, RowPlan, View
from precache.methods.split import SplitKVMethod
from precache.methods.state import CacheState, author_runs


class PreLRShared(SplitKVMethod):
    name = "prelrshared"
    rebuilds_by_author = True  # the author's row writes the base and every LR cache (fact 4)

    def plans(self, state, agent, token_ids, pos0):
        end = pos0 + len(token_ids)
        writes = [BaseWrite(state.base), *self.lr_writes(state, self.adapters)]
        lr = state.lr.get(agent) if agent is not None else None
        view = View(state.base, 0, end, lr, self.adapter(agent))
        return [RowPlan(token_ids, pos0, self.adapter(agent), writes, [view])]

    def catch_up(self, state: CacheState, agent, token_ids, authors):
        """An agent added at run time gets the LR rows PreLRShared would have written had it been
        loaded from the start: each segment's author runs again over it (reading the caches it
        read then, so its hidden states ``h^j`` come out as they did) and writes only ``h^j A_a``.
        Where the author is unknown (blocks from another trajectory) or no longer loaded, the base
        model's hidden states ``h^0`` stand in (DESIGN.md, "Adapters loaded at run time")."""
        if agent is None or agent not in state.late:
            return []
        state.late.discard(agent)
        view, write = state.lr[agent], LRWrite(state.lr[agent], self.adapters[agent])
        span = [authors[p] if p < len(authors) else None for p in range(view.length, state.base.length)]

        def usable(a: str) -> bool:
            return a in self.adapters and a not in state.late and a != agent

        runs = [(s + view.length, e + view.length, a) for s, e, a in author_runs(span, usable)]
        return [
            RowPlan(
                token_ids[s:e],
                s,
                self.adapter(a),
                [write],
                [View(state.base, 0, e, state.lr[a] if a is not None else None, self.adapter(a))],
                want_logits=False,
            )
            for s, e, a in runs
        ]
