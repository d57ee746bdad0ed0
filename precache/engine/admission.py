"""Admission: which waiting request starts (or, preempted, resumes) in this step.

First come, first served: waiting requests are taken oldest first, a session runs one request at a
time (a later request on a busy session waits without holding back other sessions' requests), at
most ``max_running`` run at once, and the first request whose blocks do not fit stops admission for
this step (a younger request never overtakes an older one for memory). A step that had to preempt
admits nothing (vLLM's rule: the pool is short already).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from precache.cache.pool import KVPool
from precache.engine.preemption import resume, resume_blocks
from precache.engine.request import Request, RequestState
from precache.engine.rows import Batch, RunningSet, StepBudget, out_of_blocks
from precache.engine.swap_space import SwapSpace


class Admission:
    """The waiting requests of one engine, oldest first (``waiting``: new ones, and preempted ones
    until they resume), and which of them start in a step. A start takes blocks from the ``pool``:
    a preempted request's caches come back from the ``swap_space`` (or are rebuilt with
    ``forward(plans)`` when it dropped them), a new one opens its turn; then it joins ``running``.
    """

    def __init__(
        self,
        pool: KVPool | None,
        swap_space: SwapSpace,
        running: RunningSet,
        forward: Callable[[list], list],
    ):
        self.pool, self.swap_space, self.running, self.forward = pool, swap_space, running, forward
        self.waiting: list[Request] = []

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, request: Request) -> None:
        """Queue ``request`` by age (a preempted one goes back before every younger request)."""
        bisect.insort(self.waiting, request, key=lambda r: r.priority)

    def drop_cancelled(self, batch: Batch) -> None:
        """End the waiting requests whose cancel was asked before they started (CANCELLED)."""
        for r in [r for r in self.waiting if r.cancel_requested and r.phase is None]:
            self.waiting.remove(r)
            r.state = RequestState.CANCELLED
            batch.finished.append(r)

    def admit(self, step: StepBudget, max_running: int) -> None:
        """Start or resume waiting requests oldest first while their blocks fit the step, at most
        ``max_running`` running at once."""
        for r in list(self.waiting):
            if len(self.running) >= max_running:
                return
            if not session_free(r):
                continue  # its session's earlier request runs first; other sessions go on
            if step.blocks is not None:
                need = self.start_blocks(r, step.tokens)
                if need > step.blocks:
                    step.make_room(need, r, preempt=False)
                if need > step.blocks and (self.running or r.phase is not None):
                    if r.phase is not None and not self.running:  # could not come back, ever
                        self.waiting.remove(r)
                        self.running.fail(r, out_of_blocks(r, need, step.blocks, self.pool), step.batch)
                    return  # first come, first served: nobody younger overtakes it
            self.waiting.remove(r)
            if not self._start(r, step):
                return

    def _start(self, r: Request, step: StepBudget) -> bool:
        """Open ``r``'s turn (or swap its caches back in, or rebuild them when the swap space dropped
        them) and take its first rows. All may take blocks the step counted as available (a
        swap-in; a rebuild; cached blocks a prefix match attaches), so the step's room shrinks by
        what they took."""
        before = self.pool.allocator.num_available if self.pool is not None else 0
        try:
            if r.swapped is not None:
                resume(r, self.swap_space)
            if r.session.dropped:
                self.swap_space.rebuild(r.session, r.agent, self.forward)
            if r.phase is None:
                r.open()
        except Exception as exc:
            self.running.fail(r, exc, step.batch)
            return True
        finally:
            step.charge_since(before)
        self.running.add(r)
        return r.held or step.take(r, preempt=False)

    def start_blocks(self, request: Request, max_prefill: int | None) -> int:
        """Blocks ``request`` needs to run its first rows: its session's caches back (swapped in, or
        rebuilt when they were dropped), then its next decode row (preempted) or its first prefill
        chunk (new: an estimate from the method's cached length, plus one block for a partly filled
        last block or a turn-local cache that starts mid-block)."""
        back = resume_blocks(request, self.swap_space)
        if request.phase is not None:  # preempted: its caches back, then a decode row
            return back + 1
        session = request.session
        cached = len(session.authors) if session.dropped else session.method.cached_length(session.state)
        left = len(session.token_ids) - cached
        if max_prefill is not None:
            left = min(left, max_prefill)
        return back + self.pool.blocks_for(max(left, 1)) + 1


def session_free(request: Request) -> bool:
    """No other request runs on the request's session."""
    active = request.session.active
    return active is None or active is request
