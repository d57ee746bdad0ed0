"""Admission: which waiting request starts (or, preempted, resumes) in this step.

First come, first served: waiting requests are taken oldest first, a session runs one request at a
time (a later request on a busy session waits without holding back other sessions' requests), at
most ``max_running`` run at once, and the first request whose blocks do not fit stops admission for
this step (a younger request never overtakes an older one for memory). A step that had to preempt
admits nothing (vLLM's rule: the pool is short already).
"""

from __future__ import annotations

from precache.cache.pool import KVPool
from precache.engine.preemption import resume_blocks
from precache.engine.request import Request
from precache.engine.swap_space import SwapSpace


def start_blocks(request: Request, pool: KVPool, max_prefill: int | None, space: SwapSpace) -> int:
    """Blocks ``request`` needs to run its first rows: its session's caches back (swapped in, or
    rebuilt when they were dropped), then its next decode row (preempted) or its first prefill chunk
    (new: an estimate from the method's cached length, plus one block for a partly filled last block
    or a turn-local cache that starts mid-block)."""
    back = resume_blocks(request, space)
    if request.phase is not None:  # preempted: its caches back, then a decode row
        return back + 1
    session = request.session
    cached = len(session.authors) if session.dropped else session.method.cached_length(session.state)
    left = len(session.token_ids) - cached
    if max_prefill is not None:
        left = min(left, max_prefill)
    return back + pool.blocks_for(max(left, 1)) + 1


def session_free(request: Request) -> bool:
    """No other request runs on the request's session."""
    active = request.session.active
    return active is None or active is request
