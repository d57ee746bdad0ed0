"""Preemption: who gives its blocks back when the oldest requests need them, and how.

Policy (vLLM's, first come first served): requests are served oldest first; when a running
request's rows do not fit what the pool can hand out, idle sessions the owner lets go are
reclaimed first (the server's cached conversations), then idle library sessions are swapped out
(least recently used first; they come back at their next turn), then the youngest running request
that is not in this step's batch is preempted, and so on, never an older one. A preempted request's
session caches are swapped out to host memory (:mod:`precache.cache.swap`), so it keeps the tokens
it generated and resumes where it stopped, on caches equal bit for bit, when the pool has room
again (before any younger waiting request starts). Host memory is bounded by the engine's
:class:`~precache.engine.swap_space.SwapSpace`: past it, the least recently used idle sessions'
copies are dropped and their caches rebuilt from their tokens at their next request. The oldest running request can always run: it
passed :meth:`~precache.methods.base.SharingMethod.check_fits` when it started, and everything
younger can be swapped out.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

from precache.engine.request import Request, RequestState
from precache.engine.rows import Batch, RunningSet
from precache.engine.session import Session
from precache.engine.swap_space import SwapSpace

logger = logging.getLogger(__name__)


class Preemption:
    """Who gives blocks back when a step is short of them, for one engine. It owns the host
    ``swap_space``, the engine's live sessions (:meth:`track`; idle ones are swapped out before any
    request is preempted), the idle-session hook ``reclaim`` and ``preemptions`` (requests swapped
    out over the engine's life). A preempted request leaves ``running`` and goes back to the
    waiting queue through ``requeue``.

    ``reclaim(n)``, when set, lets the owner of idle sessions give back about ``n`` blocks (the
    server drops cached conversations) and returns the blocks it freed.
    """

    def __init__(self, swap_space: SwapSpace, running: RunningSet, requeue: Callable[[Request], None]):
        self.swap_space, self.running, self.requeue = swap_space, running, requeue
        self.reclaim: Callable[[int], int] | None = None
        self.preemptions = 0
        self._sessions: weakref.WeakSet = weakref.WeakSet()  # every session of the engine
        self._sessions_lock = threading.Lock()  # sessions are made on any thread

    def track(self, session: Session) -> None:
        """Know ``session`` (any thread): an idle one may be swapped out when the pool needs blocks."""
        with self._sessions_lock:
            self._sessions.add(session)

    def sessions(self) -> list[Session]:
        """The engine's live sessions, a snapshot."""
        with self._sessions_lock:
            return list(self._sessions)

    def make_room(self, short: int, than: Request, batch: Batch, preempt: bool) -> int:
        """Give back at least ``short`` blocks if possible: idle sessions first (``reclaim``, then
        swapped out), then, with ``preempt``, the youngest running requests younger than ``than``
        and not in ``batch``; returns the blocks freed."""
        freed = self.reclaim(short) if self.reclaim is not None else 0
        for session in idle_victims(self.sessions()) if freed < short else ():
            if freed >= short:
                break
            freed += self.swap_space.swap_out(session)
        scheduled = {q.id for q in batch.requests}
        while preempt and freed < short:
            victim = self.running.youngest(than, scheduled)
            if victim is None:
                break
            freed += preempt_request(victim, self.swap_space)
            self.running.remove(victim)
            self.requeue(victim)
            batch.preempted += 1
            self.preemptions += 1
        return freed


def preempt_request(request: Request, space: SwapSpace) -> int:
    """Swap ``request``'s session caches out; the request is PREEMPTED. Returns the blocks freed."""
    freed = space.swap_out(request.session)
    request.state = RequestState.PREEMPTED
    request.preemptions += 1
    logger.debug("preempted request %d (%d blocks back in the pool)", request.id, freed)
    return freed


def idle_victims(sessions) -> list[Session]:
    """Sessions with no request on them whose caches hold pool blocks, least recently used first
    (a library user's idle trajectories: swapped out before any running request is preempted)."""
    idle = [s for s in sessions if s.active is None and s.swapped is None and not s.dropped]
    idle = [s for s in idle if any(st.blocks for st in s.state.paged_stores())]
    return sorted(idle, key=lambda s: s.last_used)


def resume_blocks(request: Request, space: SwapSpace) -> int:
    """Blocks bringing ``request``'s session caches back takes: swapping them in, or rebuilding them
    when they were dropped (0 when they are resident)."""
    swapped = request.session.swapped
    if swapped is not None:
        return swapped.num_blocks
    return space.rebuild_blocks(request.session, request.agent)


def resume(request: Request, space: SwapSpace) -> None:
    """Swap ``request``'s session caches back in; a preempted request is RUNNING again.

    Raises:
        OutOfBlocksError: the pool cannot hand out :func:`resume_blocks` blocks now.
    """
    space.swap_in(request.session)
    if request.state is RequestState.PREEMPTED:
        request.state = RequestState.RUNNING
        logger.debug("resumed request %d", request.id)
