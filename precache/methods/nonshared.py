"""NonShared: every agent keeps its own full KV cache from its own adapted forward.

At its honest best (DESIGN.md): an agent keeps its cache across turns and prefills only what the
other agents added since its last turn, so N agents read each token at most N times.
"""

from __future__ import annotations

from precache.cache.rowplan import FullWrite, RowPlan, View
from precache.cache.views import materialise_view
from precache.methods.base import SharingMethod
from precache.methods.state import CacheState

_BASE_KEY = "<base>"


class NonShared(SharingMethod):
    name = "nonshared"

    def empty_state(self) -> CacheState:
        return CacheState(full={a: self.new_kv_store() for a in [*self.adapters, _BASE_KEY]})

    def _own(self, state: CacheState, agent: str | None):
        return state.full[_BASE_KEY if agent is None else agent]

    def view_kv(self, state, agent, layer, end):
        own = self._own(state, agent)  # an agent's view covers what it has read
        return materialise_view(self.model, layer, View(own, 0, min(end, own.length)))

    def add_agent_cache(self, state: CacheState, agent: str) -> None:
        state.full[agent] = self.new_kv_store()  # read from token 0 at its first turn, as any agent's

    @staticmethod
    def _key(agent: str, uid: int | None) -> str:
        return agent if agent == _BASE_KEY else f"{agent}#{uid}"  # a load of an adapter, not its name

    def prefix_stores(self, state: CacheState):
        # an agent reuses only what the same load of the same adapter wrote
        return {self._key(a, state.uids.get(a)): s for a, s in state.full.items()}

    def reuse_key(self, state: CacheState, agent: str | None) -> str | None:
        return _BASE_KEY if agent is None else self._key(agent, self.adapter_uid.get(agent))

    def cached_length(self, state: CacheState) -> int:
        return max(s.length for s in state.full.values())

    def prefill_start(self, state: CacheState, agent: str | None) -> int:
        return self._own(state, agent).length

    def plans(self, state, agent, token_ids, pos0):
        own = self._own(state, agent)
        end = pos0 + len(token_ids)
        return [RowPlan(token_ids, pos0, self.adapter(agent), [FullWrite(own)], [View(own, 0, end)])]

    def rebuild(self, state, agent, token_ids, authors):
        """The returning agent's own cache over the tokens cached before the drop, from its own
        forward as it was written; every other agent's cache comes back at its next turn, whose
        prefill reads from token 0 (the same entries: each agent's cache is its own)."""
        n = len(authors)
        if n == 0:
            return []
        own = self._own(state, agent)
        return [RowPlan(token_ids[:n], 0, self.adapter(agent), [FullWrite(own)], [View(own, 0, n)], False)]

    def check(self, state: CacheState) -> None:
        return None  # each agent's cache covers the prefix it has read; no cross-store invariant
