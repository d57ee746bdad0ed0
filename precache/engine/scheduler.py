"""The engine scheduler: continuous batching over every request of one engine.

:meth:`Scheduler.step` is schedule -> run -> postprocess, in named phases, each the work of one
small manager that owns its queue or budget:

- :class:`~precache.engine.admission.Admission` owns the waiting queue (new and preempted
  requests, oldest first): it drops the cancelled ones, and starts or resumes the others while
  their first rows fit;
- :class:`~precache.engine.rows.RunningSet` owns the running requests: each puts its rows in the
  step (a decode token, the post-turn pass, or a prefill chunk), oldest first; it retires the
  finished ones;
- :class:`~precache.engine.rows.StepBudget` owns one step's batch and budget: the pool blocks it
  may still take and the prefill tokens left of ``max_step_tokens``;
- :class:`~precache.engine.preemption.Preemption` owns the swap space and the engine's sessions:
  when a request's rows do not fit, idle sessions give their blocks back, then younger running
  requests are preempted (only while scheduling the running ones: a step that preempted admits
  nothing);
- :class:`~precache.engine.parallel.ParallelSampling` forks the ``n`` choices of a request whose
  prompt was just prefilled.

One forward runs every row; each request books it and samples its token.

Concurrency without an event loop: any thread waiting on a request drives steps
(:meth:`Scheduler.drive`); one thread steps at a time and every step serves all requests, so N
threads each running a session get their rows batched into one forward per step. Requests may be
added and cancelled from any thread at any time.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from precache.cache.pool import KVPool
from precache.engine.admission import Admission
from precache.engine.config import SchedulerConfig
from precache.engine.parallel import ParallelSampling
from precache.engine.preemption import Preemption
from precache.engine.request import Request
from precache.engine.rows import Batch, RunningSet, StepBudget
from precache.engine.swap_space import UNBOUNDED_SWAP_SPACE, SwapSpace
from precache.errors import PrecacheError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Scheduler:
    """Requests of one engine: ``waiting`` (new or preempted, oldest first) and ``running`` (oldest
    first), within ``config``'s limits. ``forward(plans)`` runs row plans as one batch and returns
    each plan's logits (:func:`~precache.cache.plan.run_plans`).

    With the engine's block ``pool``, a step takes rows only while the blocks they write fit what
    the pool can hand out (free or evictable), making room as :class:`Preemption` says; a request
    that cannot fit even alone fails with :class:`~precache.errors.OutOfBlocksError`. ``swap_space``
    bounds the host memory swapped-out caches take (:class:`~precache.engine.swap_space.SwapSpace`;
    default: unbounded); a request whose session's caches it dropped rebuilds them as it starts.
    ``runner(fn)`` runs each step (the engine's: :func:`precache.compute.on_compute`, one OS thread
    for every step whichever thread drives it).
    """

    def __init__(
        self,
        forward: Callable[[list], list],
        config: SchedulerConfig | None = None,
        pool: KVPool | None = None,
        runner: Callable[[Callable[[], T]], T] | None = None,
        swap_space: SwapSpace | None = None,
    ):
        self.forward, self.pool = forward, pool
        self.swap_space = swap_space or SwapSpace(pool, UNBOUNDED_SWAP_SPACE)
        self.runner = runner or (lambda fn: fn())
        self.config = config or SchedulerConfig()
        self.running_set = RunningSet(self.swap_space)
        # a rebuild runs through self.forward as it is at the time (tests swap it)
        self.admission = Admission(pool, self.swap_space, self.running_set, lambda plans: self.forward(plans))
        self.preemption = Preemption(self.swap_space, self.running_set, self.admission.add)
        self.parallel = ParallelSampling(self.running_set)
        self.steps = 0  # forwards run
        self._inbox: deque[Request] = deque()  # added from any thread, taken in by the stepping one
        self._cv = threading.Condition()
        self._stepping = False

    @property
    def waiting(self) -> list[Request]:
        """The waiting requests, oldest first (read it between steps)."""
        return self.admission.waiting

    @property
    def running(self) -> list[Request]:
        """The running requests, oldest first (read it between steps)."""
        return self.running_set.requests

    @property
    def preemptions(self) -> int:
        """Requests swapped out over the scheduler's life."""
        return self.preemption.preemptions

    @property
    def has_work(self) -> bool:
        return bool(self._inbox or self.waiting or self.running)

    def add(self, request: Request) -> None:
        """Queue ``request`` (any thread); it joins the batch at the next step."""
        self._inbox.append(request)

    def requests_of(self, agent: str) -> int:
        """How many requests of ``agent`` are queued, waiting or running (call between steps)."""
        queued = [*self._inbox, *self.waiting, *self.running]
        return sum(1 for r in queued if r.agent == agent and not r.all_finished)

    def track(self, session) -> None:
        """Know ``session`` (any thread): an idle one may be swapped out when the pool needs blocks."""
        self.preemption.track(session)

    def cancel(self, request: Request) -> None:
        """Cancel ``request`` and its choices (any thread) at the next step: a waiting one ends
        CANCELLED at once, a running (or preempted, once resumed) turn closes (its tokens so far stay
        in the trajectory) and runs its post-turn pass."""
        request.cancel_requested = True
        for child in request.children:
            child.cancel_requested = True

    # -- stepping: one thread at a time ----------------------------------------------------------
    def step(self) -> Batch:
        """Run one step; waits while another thread runs one."""
        return self.exclusive(self._step)

    def exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` as this thread's turn to step (waits while another thread steps): a step, or
        e.g. an idle session's swap-in, which no forward may see half done."""
        with self._cv:
            while self._stepping:
                self._cv.wait()
            self._stepping = True
        try:
            return self.runner(fn)
        finally:
            self._release()

    def drive(self, until: Callable[[], bool]) -> None:
        """Run steps until ``until()`` holds, or wait while another thread steps (its steps serve
        this thread's requests too).

        Raises:
            RuntimeError: nothing can run and ``until()`` is still false (a request never submitted).
        """
        while True:
            with self._cv:
                while self._stepping and not until():
                    self._cv.wait()
                if until():
                    return
                self._stepping = True
            try:
                batch = self.runner(self._step)
            finally:
                self._release()
            if not batch.requests and not batch.finished and not batch.preempted and not until():
                raise RuntimeError("the scheduler has nothing to run for the awaited request")

    def _release(self) -> None:
        with self._cv:
            self._stepping = False
            self._cv.notify_all()

    def _step(self) -> Batch:
        batch = Batch()
        while self._inbox:  # requests added since the last step
            self.admission.add(self._inbox.popleft())
        self.admission.drop_cancelled(batch)
        self.running_set.close_cancelled()
        step = StepBudget(
            batch, self.pool, self.config.max_step_tokens, self.running_set, self.preemption.make_room
        )
        self.running_set.schedule(step)  # running requests' rows, preempting younger ones when short
        if not batch.preempted:
            self.admission.admit(step, self.config.max_running)  # waiting requests start or resume
        if batch.requests:
            self._run(batch)
        self.running_set.retire(batch)
        return batch

    # -- running and postprocessing --------------------------------------------------------------
    def _run(self, batch: Batch) -> None:
        """One forward over every row of ``batch``; then each request books it and samples."""
        try:
            logits = self.forward([p for plans in batch.plans for p in plans])
        except Exception as exc:
            if isinstance(exc, PrecacheError):
                logger.warning(
                    "a batched forward failed (%s); failing its %d requests", exc, len(batch.requests)
                )
            else:
                logger.exception("a batched forward failed; failing its %d requests", len(batch.requests))
            for r in batch.requests:
                self.running_set.fail(r, exc, batch)
            return
        self.steps += 1
        self._postprocess(batch, logits)

    def _postprocess(self, batch: Batch, logits: list) -> None:
        i = 0
        for r, plans in zip(batch.requests, batch.plans, strict=True):
            first, i = logits[i], i + len(plans)
            try:
                if not r.ran():
                    continue
                self.parallel.sample_choices(r, first)
                r.sample(first)
            except Exception as exc:
                logger.exception("sampling failed for request %d", r.id)
                self.running_set.fail(r, exc, batch)
