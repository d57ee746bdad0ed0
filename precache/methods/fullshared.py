"""FullShared: one full KV cache, each token written once with its author's adapter.

The compute limit the shared methods approach: every token is prefilled exactly once. The
other agents read the author's adapted K/V unchanged, which is where its fidelity loss comes from.
"""

from __future__ import annotations

from precache.cache.rowplan import FullWrite, RowPlan, View
from precache.cache.views import materialise_view
from precache.methods.base import SharingMethod
from precache.methods.state import CacheState


class FullShared(SharingMethod):
    name = "fullshared"
    rebuilds_by_author = True  # one cache, each token written by its author's row

    def empty_state(self) -> CacheState:
        return CacheState(full={"shared": self.new_kv_store()})

    def view_kv(self, state, agent, layer, end):
        shared = state.full["shared"]
        return materialise_view(self.model, layer, View(shared, 0, min(end, shared.length)))

    def prefix_stores(self, state: CacheState):
        return {"shared": state.full["shared"]}

    def reuse_key(self, state: CacheState, agent: str | None) -> str | None:
        return "shared"

    def cached_length(self, state: CacheState) -> int:
        return state.full["shared"].length

    def plans(self, state, agent, token_ids, pos0):
        shared = state.full["shared"]
        end = pos0 + len(token_ids)
        return [RowPlan(token_ids, pos0, self.adapter(agent), [FullWrite(shared)], [View(shared, 0, end)])]
