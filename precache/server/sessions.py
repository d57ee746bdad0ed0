"""The server's sessions: lookup by token prefix across adapters, one request per session at a
time, forks of a shared prefix; idle sessions are dropped least recently used first when the
engine's block pool (the one memory budget) needs their blocks.

Used from the scheduler thread only (no locks): sessions and their caches are never touched by
two threads.
"""

from __future__ import annotations

import gc
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass

from precache.cache.prefix import TrajectoryIndex
from precache.engine.session import Session

logger = logging.getLogger(__name__)


@dataclass
class PooledSession:
    """A session and its bookkeeping. ``anchor``: the prompt length of its latest request; a prompt
    that shares at least that many tokens continues the conversation (it may only rewrite the
    latest answer), a shorter match is a branch from its history. ``tenant``: whose it is (None:
    the default tenant; also the session's ``cache_salt``)."""

    sid: str
    session: Session
    tenant: str | None = None
    anchor: int = 0
    busy: bool = False
    how: str = "new"  # how the latest claim found it: "pinned", "reuse", "fork" or "new"
    common: int = 0  # prompt tokens it already held at the latest claim

    @property
    def key(self) -> tuple[str | None, str]:
        """The pool's key: ``(tenant, session id)``."""
        return self.tenant, self.sid


class SessionPool:
    """Sessions by ``(tenant, id)``, their trajectories indexed by the engine's salted block-hash
    chain (:class:`~precache.cache.prefix.TrajectoryIndex`, the tenant as the salt).

    A request sees its own tenant's sessions only: its lookup follows its tenant's hash chain alone, a
    pinned ``session_id`` names a session of its tenant (another tenant's session of the same name
    is another session), and every new or forked session carries the tenant as its ``cache_salt``.

    Lookup (:meth:`acquire`), for a prompt without a pinned ``session_id``:

    1. the session sharing the longest prefix that the prompt *continues* (shares at least its
       ``anchor``) is taken, whatever adapter wrote it; if it is busy the request waits (None),
       so a conversation's requests run one after the other on one cache;
    2. otherwise, when a free session shares at least ``min_fork_tokens`` tokens (a common system
       prompt, a branch), its prefix goes into a new session (:meth:`Session.fork`: the blocks are
       shared, not copied), so one conversation never cuts another's cache;
    3. otherwise a new, empty session: unrelated conversations share nothing.

    The taken session is synced to the prompt (:meth:`Session.sync` cuts every cache back to the
    common prefix). Memory: the engine's block pool is the only budget; when it needs blocks, it
    calls :meth:`reclaim`, which drops idle sessions least recently used first.
    """

    def __init__(self, engine, min_fork_tokens: int = 32):
        self.engine, self.min_fork_tokens = engine, min_fork_tokens
        self.entries: OrderedDict[tuple, PooledSession] = OrderedDict()  # least recently used first
        self.index = TrajectoryIndex(engine.pool.block_size)

    def __len__(self) -> int:
        return len(self.entries)

    def acquire(
        self, prompt_ids: list[int], session_id: str | None = None, tenant: str | None = None
    ) -> PooledSession | None:
        """Claim a session of ``tenant`` for ``prompt_ids`` and sync it to them; None: wait, the
        session is busy."""
        if session_id is not None:
            entry = self.entries.get((tenant, session_id)) or self._add(
                Session(self.engine, id=session_id, cache_salt=tenant)
            )
            return None if entry.busy else self._claim(entry, prompt_ids, "pinned")
        fork_from: tuple[PooledSession, int] | None = None
        for key, common in self.index.match(prompt_ids, tenant):
            entry = self.entries[key]
            if common >= entry.anchor:
                return None if entry.busy else self._claim(entry, prompt_ids, "reuse")
            if fork_from is None and not entry.busy and common >= max(1, self.min_fork_tokens):
                fork_from = (entry, common)
        if fork_from is not None:
            parent, common = fork_from
            child = self._add(parent.session.fork(common))
            return self._claim(child, prompt_ids, "fork")
        return self._claim(self._add(self.engine.session(cache_salt=tenant)), prompt_ids, "new")

    def release(self, entry: PooledSession) -> None:
        """The request on ``entry`` is over: index its whole trajectory and make it reusable."""
        entry.busy = False
        if entry.key in self.entries:
            self.index.set(entry.key, entry.session.token_ids, entry.tenant)
            self.entries.move_to_end(entry.key)

    def discard(self, entry: PooledSession) -> None:
        """Forget ``entry`` and give its cache blocks back to the pool."""
        self.entries.pop(entry.key, None)
        self.index.remove(entry.key)
        if entry.session.active is None:
            entry.session.close()

    def check(self) -> int:
        """The integrity check of every cached session and of the block pool: each session's
        :meth:`Session.check`, the allocator's rules, and its reference counts equal to the tables
        of the sessions (call when no request runs). Returns the number of sessions.

        Raises:
            CacheIntegrityError: an invariant does not hold.
        """
        gc.collect()  # sessions dropped mid-turn give their blocks back when collected
        holders: Counter[int] = Counter()
        for entry in self.entries.values():
            entry.session.check()
            state = entry.session.state
            for store in {
                id(s): s for s in (state.base, state.turn, *state.full.values()) if s is not None
            }.values():
                holders.update(store.blocks)
        self.engine.pool.allocator.check(dict(holders))
        return len(self.entries)

    def reclaim(self, blocks: int) -> int:
        """Drop idle sessions, least recently used first, until the engine's pool has handed back
        ``blocks`` blocks or none is left; return the blocks freed (their published blocks stay
        cached for prefix reuse, and count as available)."""
        alloc = self.engine.pool.allocator
        before = alloc.num_available
        for entry in [e for e in self.entries.values() if not e.busy and e.session.active is None]:
            if alloc.num_available - before >= blocks:
                break
            self.discard(entry)
            logger.debug("dropped idle session %s to free cache blocks", entry.sid)
        return alloc.num_available - before

    def _add(self, session: Session) -> PooledSession:
        entry = PooledSession(session.id, session, session.cache_salt)
        self.entries[entry.key] = entry
        return entry

    def _claim(self, entry: PooledSession, prompt_ids: list[int], how: str) -> PooledSession:
        try:
            common = entry.session.sync(prompt_ids)
        except Exception:
            if not entry.session.token_ids:
                self.discard(entry)
            raise
        entry.busy = True
        self.entries.move_to_end(entry.key)
        entry.anchor = len(prompt_ids)
        self.index.set(entry.key, prompt_ids, entry.tenant)
        entry.how, entry.common = how, common
        return entry
