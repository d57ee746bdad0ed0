"""The server's sessions: lookup by token prefix across adapters, one request per session at a
time, forks of a shared prefix, and LRU eviction under a byte budget.

Used from the scheduler thread only (no locks): sessions and their caches are never touched by
two threads.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from precache.engine.session import Session
from precache.server.prefix import TokenTrie

logger = logging.getLogger(__name__)


@dataclass
class PooledSession:
    """A session and its bookkeeping. ``anchor``: the prompt length of its latest request; a prompt
    that shares at least that many tokens continues the conversation (it may only rewrite the
    latest answer), a shorter match is a branch from its history."""

    sid: str
    session: Session
    anchor: int = 0
    busy: bool = False
    idle_bytes: int = 0  # cache bytes when last released (an idle session's caches do not change)

    def nbytes(self) -> int:
        """Bytes held by the session's caches now."""
        return self.session.cache_bytes()["total"] if self.busy else self.idle_bytes


@dataclass(frozen=True)
class Claim:
    """What :meth:`SessionPool.acquire` handed out: ``how`` is ``"pinned"``, ``"reuse"``, ``"fork"``
    or ``"new"``; ``common`` the prompt tokens the session already held (before its caches count)."""

    entry: PooledSession
    how: str
    common: int


class SessionPool:
    """Sessions by id with a :class:`TokenTrie` over their trajectories.

    Lookup (:meth:`acquire`), for a prompt without a pinned ``session_id``:

    1. the session sharing the longest prefix that the prompt *continues* (shares at least its
       ``anchor``) is taken, whatever adapter wrote it; if it is busy the request waits (None),
       so a conversation's requests run one after the other on one cache;
    2. otherwise, when a free session shares at least ``min_fork_tokens`` tokens (a common system
       prompt, a branch), its prefix goes into a new session (:meth:`Session.fork`: the blocks are
       shared, not copied), so one conversation never cuts another's cache;
    3. otherwise a new, empty session: unrelated conversations share nothing.

    The taken session is synced to the prompt (:meth:`Session.sync` cuts every cache back to the
    common prefix). ``max_bytes`` bounds the sum of ``cache_bytes()["total"]`` over sessions;
    :meth:`evict` drops idle sessions, least recently used first.
    """

    def __init__(self, engine, max_bytes: int | None = None, min_fork_tokens: int = 32):
        self.engine, self.max_bytes, self.min_fork_tokens = engine, max_bytes, min_fork_tokens
        self.entries: OrderedDict[str, PooledSession] = OrderedDict()  # least recently used first
        self.trie = TokenTrie()

    def __len__(self) -> int:
        return len(self.entries)

    def acquire(self, prompt_ids: list[int], session_id: str | None = None) -> Claim | None:
        """Claim a session for ``prompt_ids`` and sync it to them; None: wait, the session is busy."""
        if session_id is not None:
            entry = self.entries.get(session_id) or self._add(Session(self.engine, id=session_id))
            return None if entry.busy else self._claim(entry, prompt_ids, "pinned")
        fork_from: tuple[PooledSession, int] | None = None
        for sid, common in self.trie.match(prompt_ids):
            entry = self.entries[sid]
            if common >= entry.anchor:
                return None if entry.busy else self._claim(entry, prompt_ids, "reuse")
            if fork_from is None and not entry.busy and common >= max(1, self.min_fork_tokens):
                fork_from = (entry, common)
        if fork_from is not None:
            parent, common = fork_from
            child = self._add(parent.session.fork(common))
            return self._claim(child, prompt_ids, "fork")
        return self._claim(self._add(self.engine.session()), prompt_ids, "new")

    def release(self, entry: PooledSession) -> None:
        """The request on ``entry`` is over: index its whole trajectory and make it reusable."""
        entry.busy = False
        entry.idle_bytes = entry.session.cache_bytes()["total"]
        if entry.sid in self.entries:
            self.trie.set(entry.sid, entry.session.token_ids)
            self.entries.move_to_end(entry.sid)

    def discard(self, entry: PooledSession) -> None:
        """Forget ``entry`` and give its cache blocks back to the pool."""
        self.entries.pop(entry.sid, None)
        self.trie.remove(entry.sid)
        if entry.session.active is None:
            entry.session.close()

    def total_bytes(self) -> int:
        """Bytes held by every session's caches."""
        return sum(e.nbytes() for e in self.entries.values())

    def evict(self) -> int:
        """Drop idle sessions, least recently used first, until the budget holds; return how many."""
        if self.max_bytes is None:
            return 0
        sizes = {sid: e.nbytes() for sid, e in self.entries.items()}
        total, dropped = sum(sizes.values()), 0
        for sid in [sid for sid, e in self.entries.items() if not e.busy]:
            if total <= self.max_bytes:
                break
            self.discard(self.entries[sid])
            total -= sizes[sid]
            dropped += 1
        if dropped:
            logger.debug("evicted %d idle sessions; %d cache bytes held", dropped, total)
        return dropped

    def drop_idle(self) -> bool:
        """Drop the least recently used idle session (its cache blocks go back to the engine's pool);
        False when every session is busy."""
        for sid, entry in self.entries.items():
            if not entry.busy:
                self.discard(entry)
                logger.debug("dropped idle session %s to free cache blocks", sid)
                return True
        return False

    def _add(self, session: Session) -> PooledSession:
        entry = PooledSession(session.id, session)
        self.entries[session.id] = entry
        return entry

    def _claim(self, entry: PooledSession, prompt_ids: list[int], how: str) -> Claim:
        try:
            common = entry.session.sync(prompt_ids)
        except Exception:
            entry.idle_bytes = entry.session.cache_bytes()["total"]  # sync may have cut before failing
            if not entry.session.token_ids:
                self.discard(entry)
            raise
        entry.busy = True
        self.entries.move_to_end(entry.sid)
        entry.anchor = len(prompt_ids)
        self.trie.set(entry.sid, prompt_ids)
        return Claim(entry, how, common)
