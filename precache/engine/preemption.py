"""Preemption: who gives its blocks back when the oldest requests need them, and how.

Policy (vLLM's, first come first served): requests are served oldest first; when a running
request's rows do not fit what the pool can hand out, idle sessions the owner lets go are
reclaimed first (the server's cached conversations), then idle library sessions are swapped out
(least recently used first; they come back at their next turn), then the youngest running request
that is not in this step's batch is preempted, and so on, never an older one. A preempted request's
session caches are swapped out to host memory (:mod:`precache.cache.swap`), so it keeps the tokens
it generated and resumes where it stopped, on caches equal bit for bit, when the pool has room
again (before any younger waiting request starts). The oldest running request can always run: it
passed :meth:`~precache.methods.base.SharingMethod.check_fits` when it started, and everything
younger can be swapped out.
"""

from __future__ import annotations

import logging

from precache.cache.pool import KVPool
from precache.cache.swap import swap_in, swap_out
from precache.engine.request import Request, RequestState
from precache.engine.session import Session

logger = logging.getLogger(__name__)


def victim(running: list[Request], scheduled: set[int], than: Request) -> Request | None:
    """The youngest running request younger than ``than`` and not in this step's batch (ids in
    ``scheduled``), or None."""
    younger = [r for r in running if r.priority > than.priority and r.id not in scheduled]
    return max(younger, key=lambda r: r.priority, default=None)


def swap_out_session(session: Session, pool: KVPool) -> int:
    """Swap ``session``'s caches out to host memory; return the blocks this gave back."""
    before = pool.allocator.num_available
    session.swapped = swap_out(pool, session.state.paged_stores())
    return pool.allocator.num_available - before


def swap_in_session(session: Session, pool: KVPool) -> None:
    """Swap ``session``'s caches back in (no-op when they are resident).

    Raises:
        OutOfBlocksError: the pool cannot hand out the blocks now (nothing is changed).
    """
    if session.swapped is not None:
        swap_in(pool, session.swapped)
        session.swapped = None


def preempt(request: Request, pool: KVPool) -> int:
    """Swap ``request``'s session caches out; the request is PREEMPTED. Returns the blocks freed."""
    freed = swap_out_session(request.session, pool)
    request.state = RequestState.PREEMPTED
    request.preemptions += 1
    logger.debug("preempted request %d (%d blocks back in the pool)", request.id, freed)
    return freed


def idle_victims(sessions) -> list[Session]:
    """Sessions with no request on them whose caches hold pool blocks, least recently used first
    (a library user's idle trajectories: swapped out before any running request is preempted)."""
    idle = [s for s in sessions if s.active is None and s.swapped is None and s.state.paged_stores()]
    idle = [s for s in idle if any(st.blocks for st in s.state.paged_stores())]
    return sorted(idle, key=lambda s: s.last_used)


def resume_blocks(request: Request) -> int:
    """Blocks swapping ``request``'s session back in takes (0 when its caches are resident)."""
    swapped = request.session.swapped
    return swapped.num_blocks if swapped is not None else 0


def resume(request: Request, pool: KVPool) -> None:
    """Swap ``request``'s session caches back in; a preempted request is RUNNING again.

    Raises:
        OutOfBlocksError: the pool cannot hand out :func:`resume_blocks` blocks now.
    """
    swap_in_session(request.session, pool)
    if request.state is RequestState.PREEMPTED:
        request.state = RequestState.RUNNING
        logger.debug("resumed request %d", request.id)
