"""The caches of one trajectory (:class:`CacheState`), which every sharing method's hooks work on."""

from __future__ import annotations

from dataclasses import dataclass, field

from precache.cache.pool import LRView, PagedStore
from precache.cache.prefix import PrefixChain


@dataclass
class CacheState:
    """All caches of one trajectory.

    ``base``: the shared base cache (None for NonShared); ``lr[a]``: agent a's LR cache;
    ``full[a]``: a full KV cache (NonShared: one per agent; FullShared: one under ``"shared"``);
    ``turn``: the current agent's exact adapted K/V over its own turn (ReBaseShared only);
    ``turn_start``: where the open turn started (None between turns); ``prefix``: the prefix
    hashes of the shared store's full blocks (cross-trajectory reuse); ``salt``: the tenant whose
    published blocks the trajectory may reuse and publish to (None: the default tenant;
    :mod:`precache.cache.prefix`); ``uids[a]``: the load of agent a's adapter its caches were
    built for (an adapter loaded again gets new ones); ``late``: agents added at run time whose LR
    cache does not cover the trajectory yet (the method's ``catch_up`` rows fill it); ``version``:
    the adapter-set version of the last sync (a published base block holds the LR rows of the
    agents loaded when it was written).
    """

    base: PagedStore | None = None
    lr: dict[str, LRView] = field(default_factory=dict)
    full: dict[str, PagedStore] = field(default_factory=dict)
    turn: PagedStore | None = None
    turn_start: int | None = None
    prefix: dict[str, PrefixChain] = field(default_factory=dict)
    salt: str | None = None
    uids: dict[str, int] = field(default_factory=dict)
    late: set[str] = field(default_factory=set)
    version: int = 0

    def stores(self) -> list[PagedStore | LRView]:
        out = [self.base, self.turn, *self.lr.values(), *self.full.values()]
        return [s for s in out if s is not None]

    def paged_stores(self) -> list[PagedStore]:
        """The stores that hold pool blocks (the LR caches live in the base store's blocks), each once."""
        out = [self.base, self.turn, *self.full.values()]
        return list({id(s): s for s in out if s is not None}.values())


def author_runs(authors: list[str | None], known) -> list[tuple[int, int, str | None]]:
    """``authors`` as maximal runs ``(start, end, author)``, tokens ``[start, end)``; an author for
    which ``known(author)`` is false becomes None (the base model)."""
    runs: list[tuple[int, int, str | None]] = []
    for p, a in enumerate(authors):
        a = a if a is not None and known(a) else None
        if runs and runs[-1][2] == a:
            runs[-1] = (runs[-1][0], p + 1, a)
        else:
            runs.append((p, p + 1, a))
    return runs
