"""The shared shape of the methods whose caches split K/V into a base cache plus one LR cache per
agent (BaseShared, PreLRShared, ReBaseShared): ``K = Kb + RoPE(s Lk B^k)``, ``V = Vb + s Lv B^v``
(DESIGN.md, Notation)."""

from __future__ import annotations

from precache.cache.pool import LRView, PagedStore
from precache.methods.base import SharingMethod
from precache.methods.state import CacheState


class SplitKVMethod(SharingMethod):
    """A method whose state is one base cache plus one LR cache per agent (BaseShared,
    PreLRShared, ReBaseShared): the K/V split into base + LR of DESIGN.md, Notation.

    A published base block holds the LR rows of every agent loaded when it was written, so its
    prefix hash is seeded with the adapter-set version (:attr:`CacheState.version`): after an
    adapter is added, blocks published before are not taken, and a trajectory whose LR caches lag
    (``state.late``) publishes nothing."""

    splits_kv = True

    def empty_state(self) -> CacheState:
        base = self.new_kv_store()
        return CacheState(base=base, lr=self.new_lr_stores(base))

    def cached_length(self, state: CacheState) -> int:
        return state.base.length

    @staticmethod
    def _base_key(state: CacheState) -> str:
        return f"base@{state.version}" if state.version else "base"

    def prefix_stores(self, state: CacheState) -> dict[str, PagedStore]:
        return {} if state.late else {self._base_key(state): state.base}

    def reuse_key(self, state: CacheState, agent: str | None) -> str | None:
        return self._base_key(state)  # not in prefix_stores while the LR caches lag

    def add_agent_cache(self, state: CacheState, agent: str) -> None:
        state.lr[agent] = LRView(state.base, agent)
        if state.base.length:
            state.late.add(agent)
