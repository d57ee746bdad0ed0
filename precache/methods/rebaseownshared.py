"""ReBaseOwnShared (our own, beyond the paper): ReBaseShared's neutral base and LR caches for the
other agents' segments, and each agent's own earlier segments read from its exact adapted K/V
(DESIGN.md, "ReBaseOwnShared").

The study located the two paper methods' errors (benchmarks/RESULTS.md, "The study: every method
against NonShared", columns ``k_error_own`` / ``k_error_other``):
ReBaseShared reads the other agents' segments best (a neutral base, ``h^0``, plus the reader's
LR part) and its own worst (the same neutral base, where its exact K/V existed during the turn);
PreLRShared reads its own exactly and the others' through a base written from their adapters.
Here agent c reads, over an earlier position t:

- t in one of c's own earlier turns: c's exact adapted K/V, written by c's own forward in that
  turn (ReBaseShared computes it as the turn-local full cache and drops it; this method keeps it,
  one store per turn, ``state.full["<agent>@<first position>"]``);
- t in another agent's turn (or from a published block of another trajectory):
  ``Kb(h^0) + RoPE(s h^0 A_c^k B_c^k)``, ``Vb(h^0) + s h^0 A_c^v B_c^v``, exactly as ReBaseShared.

The neutral pass runs as ReBaseShared's (``schedule="lp"`` after the turn, ``"db"`` as a second
row of every forward of the turn), so the prefill count is ReBaseShared's: every token once
adapted (by its author) and once neutral. Memory: one base, N rank-r LR caches and every agent's
own segments in full, about one full cache over the trajectory in all.
"""

from __future__ import annotations

import torch

from precache.cache.pool import PagedStore
from precache.cache.rowplan import View
from precache.cache.views import materialise_view
from precache.errors import CacheIntegrityError
from precache.methods.rebaseshared import ReBaseShared
from precache.methods.state import CacheState


def own_key(agent: str, start: int) -> str:
    """The key of ``agent``'s own segment starting at ``start`` in :attr:`CacheState.full`."""
    return f"{agent}@{start}"


def key_agent(key: str) -> str:
    """The agent of an own-segment key (:func:`own_key`)."""
    return key.rsplit("@", 1)[0]


class ReBaseOwnShared(ReBaseShared):
    """ReBaseShared whose turn-local full caches are kept as the agent's own segments.

    Raises:
        ValueError: ``schedule`` is not ``"lp"`` or ``"db"``.
    """

    family = "rebaseownshared"

    def own_segments(self, state: CacheState, agent: str | None) -> list[PagedStore]:
        """``agent``'s own earlier segments (non-empty stores), in position order; none for the base
        model (its exact K/V over its own turns is the neutral base itself)."""
        if agent is None:
            return []
        stores = [s for k, s in state.full.items() if key_agent(k) == agent and s.length > s.offset]
        return sorted(stores, key=lambda s: s.offset)

    def earlier_views(self, state: CacheState, agent: str | None, end: int) -> list[View]:
        """Over ``[0, end)`` in position order: ``agent``'s own segments from their exact K/V, every
        other range from the neutral base plus ``agent``'s LR part."""
        lr = state.lr.get(agent) if agent is not None else None
        adapter, views, p = self.adapter(agent), [], 0
        for own in self.own_segments(state, agent):
            start, stop = own.offset, min(own.length, end)
            if start >= end:
                break
            if start > p:
                views.append(View(state.base, p, start, lr, adapter))
            views.append(View(own, start, stop))
            p = stop
        if p < end:
            views.append(View(state.base, p, end, lr, adapter))
        return views

    def view_kv(self, state, agent, layer, end):
        parts = [materialise_view(self.model, layer, v) for v in self.earlier_views(state, agent, end)]
        if not parts:
            return materialise_view(self.model, layer, View(state.base, 0, 0))
        return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])

    def close_turn_cache(self, state: CacheState, agent: str | None) -> None:
        """Keep the turn's exact K/V as ``agent``'s own segment (the base model's is dropped: it
        equals the neutral base)."""
        turn = state.turn
        if agent is None or turn.length <= turn.offset:
            turn.release()
            return
        key = own_key(agent, turn.offset)
        old = state.full.get(key)
        if old is not None:  # an emptied segment left by a cut back (truncate drops those; a fork may not)
            old.release()
        state.full[key] = turn

    def drop_agent_cache(self, state: CacheState, agent: str) -> None:
        super().drop_agent_cache(state, agent)
        for key in [k for k in state.full if key_agent(k) == agent]:
            state.full.pop(key).release()

    def truncate(self, state: CacheState, length: int) -> None:
        """As every method (DESIGN.md fact 6); an own segment wholly past ``length`` is dropped."""
        super().truncate(state, length)
        for key in [k for k, s in state.full.items() if s.length <= s.offset]:
            state.full.pop(key).release()

    def kept_blocks(self, state: CacheState) -> int:
        """The blocks the own segments hold (counted by :meth:`SharingMethod.check_fits`)."""
        return sum(len(s.blocks) for s in state.full.values())

    def check(self, state: CacheState) -> None:
        """ReBaseShared's invariants, and every own segment within the base and apart from the others.

        Raises:
            CacheIntegrityError: an invariant does not hold.
        """
        super().check(state)
        n = self.cached_length(state)
        for agent in {key_agent(k) for k in state.full}:
            p = 0
            for own in self.own_segments(state, agent):
                if own.offset < p or own.length > n:
                    raise CacheIntegrityError(
                        f"{self.name}: own segment [{own.offset}, {own.length}) of '{agent}' overlaps "
                        f"another or passes the base's {n} tokens"
                    )
                p = own.length
