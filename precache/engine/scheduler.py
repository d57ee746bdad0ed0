"""The engine scheduler: continuous batching over every request of one engine.

:meth:`Scheduler.step` is schedule -> run -> postprocess. Scheduling takes the running requests
oldest first, each with its rows for this step (:mod:`precache.engine.rows`: a decode token, the
post-turn pass, or a prefill chunk within ``max_step_tokens``), while their blocks fit what the
pool can hand out; a request that does not fit makes room by preempting younger ones
(:mod:`precache.engine.preemption`); then, when nothing was preempted, waiting requests start or
resume oldest first (:mod:`precache.engine.admission`). One forward runs every row; each request
books it and samples its token; a prefill that asked for ``n`` choices forks them there
(:mod:`precache.engine.parallel`).

Concurrency without an event loop: any thread waiting on a request drives steps
(:meth:`Scheduler.drive`); one thread steps at a time and every step serves all requests, so N
threads each running a session get their rows batched into one forward per step. Requests may be
added and cancelled from any thread at any time.
"""

from __future__ import annotations

import bisect
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from precache.cache.plan import blocks_needed, reserve_writes
from precache.cache.pool import KVPool
from precache.engine import admission, parallel, preemption, rows
from precache.engine.request import Phase, Request, RequestState
from precache.engine.swap_space import UNBOUNDED_SWAP_SPACE, SwapSpace
from precache.errors import OutOfBlocksError, PrecacheError

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_running``: requests in the batch at once (the rest wait); ``max_step_tokens``: prefill
    tokens per forward (chunked prefill; decode rows and post-turn passes are always added;
    None: every prefill whole, in one forward)."""

    max_running: int = 64
    max_step_tokens: int | None = None

    def __post_init__(self):
        if self.max_running < 1 or (self.max_step_tokens is not None and self.max_step_tokens < 1):
            raise ValueError(f"invalid scheduler configuration: {self}")


@dataclass
class Batch:
    """One step: the requests with rows in its forward (``plans[i]`` are ``requests[i]``'s rows, its
    first row carries the logits it samples from), the requests that finished during it, and how
    many were preempted to make room."""

    requests: list[Request] = field(default_factory=list)
    plans: list[list] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    preempted: int = 0

    @property
    def rows(self) -> int:
        """Rows of the forward (a request may have several: ReBaseShared DB's neutral row)."""
        return sum(len(p) for p in self.plans)

    @property
    def tokens(self) -> int:
        """Tokens of the forward."""
        return sum(len(row.token_ids) for plans in self.plans for row in plans)


@dataclass
class _Room:
    """What this step may still take: pool blocks (None: no pool) and prefill tokens (None: all)."""

    blocks: int | None
    tokens: int | None


class Scheduler:
    """Requests of one engine: ``waiting`` (new or preempted, oldest first) and ``running`` (oldest
    first). ``forward(plans)`` runs row plans as one batch and returns each plan's logits
    (:func:`~precache.cache.plan.run_plans`).

    With the engine's block ``pool``, a step takes rows only while the blocks they write fit what
    the pool can hand out (free or evictable). ``reclaim(n)``, when set, lets the owner of idle
    sessions give back about ``n`` blocks (the server drops cached conversations); then idle
    ``sessions`` are swapped out, and only then a running request is preempted; ``reclaim``
    returns the blocks it freed. A request that cannot fit even alone fails with
    :class:`~precache.errors.OutOfBlocksError`. ``swap_space`` bounds the host memory swapped-out
    caches take (:class:`~precache.engine.swap_space.SwapSpace`; default: unbounded); a request
    whose session's caches it dropped rebuilds them as it starts. ``runner(fn)`` runs each step
    (the engine's: :func:`precache.compute.on_compute`, one OS thread for every step whichever
    thread drives it).
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
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.reclaim: Callable[[int], int] | None = None
        self._sessions: weakref.WeakSet = weakref.WeakSet()  # every session of the engine
        self._sessions_lock = threading.Lock()  # sessions are made on any thread
        self.steps = 0  # forwards run
        self.preemptions = 0  # requests swapped out, over the scheduler's life
        self._inbox: deque[Request] = deque()  # added from any thread, taken in by the stepping one
        self._cv = threading.Condition()
        self._stepping = False

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
        with self._sessions_lock:
            self._sessions.add(session)

    def sessions(self) -> list:
        """The engine's live sessions, a snapshot."""
        with self._sessions_lock:
            return list(self._sessions)

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
        while self._inbox:
            self._enqueue(self._inbox.popleft())
        self._cancel_waiting(batch)
        room = _Room(self.pool.allocator.num_available if self.pool else None, self.config.max_step_tokens)
        self._schedule_running(batch, room)
        if not batch.preempted:
            self._admit(batch, room)
        if batch.requests:
            self._run(batch)
        self._retire(batch)
        return batch

    # -- scheduling ------------------------------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.priority)

    def _cancel_waiting(self, batch: Batch) -> None:
        for r in [r for r in self.waiting if r.cancel_requested and r.phase is None]:
            self.waiting.remove(r)
            r.state = RequestState.CANCELLED
            batch.finished.append(r)
        for r in self.running:
            if r.cancel_requested:
                r.finish("cancelled")

    def _schedule_running(self, batch: Batch, room: _Room) -> None:
        """Every running request's rows, oldest first, making room by preempting younger ones; a
        held request (``Request.held``) sits this step out."""
        for r in list(self.running):
            # not preempted earlier in this loop, nor closed (a cancelled turn with no post-turn
            # pass is DONE: it retires this step and runs no more rows), nor held
            if r.state is RequestState.RUNNING and r.phase is not Phase.DONE and not r.held:
                self._take_rows(r, batch, room, make_room=True)

    def _take_rows(self, r: Request, batch: Batch, room: _Room, make_room: bool) -> bool:
        """Put ``r``'s rows in the batch if their blocks fit (preempting younger requests when
        ``make_room``); False when they do not fit now (``r`` waits a step, or fails when it is the
        only request and can never fit)."""
        take = rows.prefill_take(r, room.tokens)
        if take == 0:
            return True  # the step's prefill budget is spent: the prefill goes on next step
        try:
            plans = r.plans(take)
        except Exception as exc:
            self._fail(r, exc, batch)
            return False
        need = blocks_needed(plans) if self.pool is not None else 0
        if room.blocks is not None and need > room.blocks:
            room.blocks += self._make_room(need - room.blocks, r, batch, preempt=make_room)
            need = blocks_needed(plans)
            if need > room.blocks:
                if not batch.requests and len(self.running) == 1:
                    self._fail(r, self._out_of_blocks(r, need, room.blocks), batch)
                return False
        if room.blocks is not None:
            try:
                reserve_writes(plans)  # held from now on: nothing started later in the step takes them
            except OutOfBlocksError as exc:
                self._fail(r, exc, batch)
                return False
            room.blocks = min(room.blocks - need, self.pool.allocator.num_available)
        if take is not None and room.tokens is not None:
            room.tokens -= take
        batch.requests.append(r)
        batch.plans.append(plans)
        return True

    def _make_room(self, short: int, r: Request, batch: Batch, preempt: bool) -> int:
        """Give back at least ``short`` blocks if possible: idle sessions first (``reclaim``), then,
        with ``preempt``, the youngest running requests younger than ``r``; returns blocks freed."""
        freed = self.reclaim(short) if self.reclaim is not None else 0
        for session in preemption.idle_victims(self.sessions()) if freed < short else ():
            if freed >= short:
                break
            freed += self.swap_space.swap_out(session)
        scheduled = {q.id for q in batch.requests}
        while preempt and freed < short:
            v = preemption.victim(self.running, scheduled, r)
            if v is None:
                break
            freed += preemption.preempt(v, self.swap_space)
            self.running.remove(v)
            self._enqueue(v)
            batch.preempted += 1
            self.preemptions += 1
        return freed

    def _out_of_blocks(self, r: Request, need: int, available: int) -> OutOfBlocksError:
        return OutOfBlocksError(
            f"request {r.id} needs {need} more KV-cache blocks and only {available} can be handed out "
            f"with no other request running: idle sessions hold the rest (close them) or raise "
            f"kv_cache_bytes (the pool has {self.pool.num_blocks} blocks)"
        )

    def _admit(self, batch: Batch, room: _Room) -> None:
        """Start or resume waiting requests oldest first while their blocks fit (admission)."""
        for r in list(self.waiting):
            if len(self.running) >= self.config.max_running:
                return
            if not admission.session_free(r):
                continue  # its session's earlier request runs first; other sessions go on
            if room.blocks is not None:
                need = admission.start_blocks(r, self.pool, room.tokens, self.swap_space)
                if need > room.blocks:
                    room.blocks += self._make_room(need - room.blocks, r, batch, preempt=False)
                if need > room.blocks and (self.running or r.phase is not None):
                    if r.phase is not None and not self.running:  # could not come back, ever
                        self.waiting.remove(r)
                        self._fail(r, self._out_of_blocks(r, need, room.blocks), batch)
                    return  # first come, first served: nobody younger overtakes it
            self.waiting.remove(r)
            if not self._start(r, batch, room):
                return

    def _start(self, r: Request, batch: Batch, room: _Room) -> bool:
        """Open ``r``'s turn (or swap its caches back in, or rebuild them when the swap space dropped
        them) and take its first rows. All may take blocks the step counted as available (a
        swap-in; a rebuild; cached blocks a prefix match attaches), so the step's room shrinks by
        what they took."""
        before = self.pool.allocator.num_available if self.pool is not None else 0
        try:
            if r.swapped is not None:
                preemption.resume(r, self.swap_space)
            if r.session.dropped:
                self.swap_space.rebuild(r.session, r.agent, self.forward)
            if r.phase is None:
                r.open()
        except Exception as exc:
            self._fail(r, exc, batch)
            return True
        finally:
            if self.pool is not None and room.blocks is not None:
                room.blocks -= max(0, before - self.pool.allocator.num_available)
        bisect.insort(self.running, r, key=lambda q: q.priority)
        return r.held or self._take_rows(r, batch, room, make_room=False)

    # -- running and postprocessing --------------------------------------------------------------
    def _run(self, batch: Batch) -> None:
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
                self._fail(r, exc, batch)
            return
        self.steps += 1
        i = 0
        for r, plans in zip(batch.requests, batch.plans, strict=True):
            first, i = logits[i], i + len(plans)
            try:
                if not r.ran():
                    continue
                if parallel.wants_choices(r):
                    for child in parallel.fork_choices(r):
                        bisect.insort(self.running, child, key=lambda q: q.priority)
                        child.sample(first)
                r.sample(first)
            except Exception as exc:
                logger.exception("sampling failed for request %d", r.id)
                self._fail(r, exc, batch)

    def _retire(self, batch: Batch) -> None:
        """Finish the requests whose turn and post-turn pass are over."""
        for r in [r for r in self.running if r.phase is Phase.DONE]:
            self.running.remove(r)
            r.complete()
            batch.finished.append(r)

    def _fail(self, request: Request, error: BaseException, batch: Batch) -> None:
        """End ``request`` with ``error``; an open turn is closed without its post-turn pass (the
        session's caches may be half-written by a failed forward)."""
        if request in self.running:
            self.running.remove(request)
        if request.phase is not None:
            request.abort("error")
        if request.swapped is not None:  # its caches never came back: the session starts over
            self.swap_space.forget(request.session)
            request.session.forget_caches()
        if request.session.active is request:
            request.session.active = None
        request.error, request.state = error, RequestState.FAILED
        batch.finished.append(request)
