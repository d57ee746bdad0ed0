"""The engine scheduler: continuous batching over every request of one engine.

Each :meth:`Scheduler.step` admits waiting requests (one per session at a time, at most
``max_running``), then runs ONE forward over the rows of every running request: decode tokens,
post-turn passes (ReBaseShared LP's neutral prefill) and prefill chunks in arrival order within
``max_step_tokens``. ReBaseShared DB's adapter-free row comes out of ``method.plans`` and rides in
the same forward. Then each request samples its token.

Concurrency without an event loop: any thread waiting on a request drives steps
(:meth:`Scheduler.drive`); one thread steps at a time and every step serves all requests, so N
threads each running a session get their rows batched into one forward per step. Requests may be
added and cancelled from any thread at any time.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TypeVar

from precache.cache.plan import blocks_needed
from precache.cache.pool import KVPool
from precache.engine.request import Request, RequestState, StreamChunk
from precache.engine.turn import SteppedTurn, TurnPhase
from precache.errors import OutOfBlocksError, PrecacheError
from precache.terminal import progress

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


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
    first row carries the logits it samples from), and the requests that finished during it."""

    requests: list[Request] = field(default_factory=list)
    plans: list[list] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Rows of the forward (a request may have several: ReBaseShared DB's neutral row)."""
        return sum(len(p) for p in self.plans)

    @property
    def tokens(self) -> int:
        """Tokens of the forward."""
        return sum(len(row.token_ids) for plans in self.plans for row in plans)


class Scheduler:
    """Requests of one engine: ``waiting`` (FIFO) and ``running``. ``forward(plans)`` runs row plans
    as one batch and returns each plan's logits (:func:`~precache.cache.plan.run_plans`).

    With the engine's block ``pool``, a step takes rows only while the blocks they write fit in
    what the pool can hand out (free or evictable); the others wait for a later step. The first
    row of a step always runs: if even it does not fit, its request fails with
    :class:`~precache.errors.OutOfBlocksError` (nothing else would free a block).
    """

    def __init__(
        self,
        forward: Callable[[list], list],
        config: SchedulerConfig | None = None,
        pool: KVPool | None = None,
    ):
        self.forward, self.pool = forward, pool
        self.config = config or SchedulerConfig()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.steps = 0  # forwards run
        self._inbox: deque[Request] = deque()  # added from any thread, taken in by the stepping one
        self._cv = threading.Condition()
        self._stepping = False

    @property
    def has_work(self) -> bool:
        return bool(self._inbox or self.waiting or self.running)

    def add(self, request: Request) -> None:
        """Queue ``request`` (any thread); it joins the batch at the next step."""
        self._inbox.append(request)

    def cancel(self, request: Request) -> None:
        """Cancel ``request`` (any thread) at the next step: a waiting one ends CANCELLED at once, a
        running turn closes (its tokens so far stay in the trajectory) and runs its post-turn pass."""
        request.cancel_requested = True

    # -- stepping: one thread at a time ----------------------------------------------------------
    def step(self) -> Batch:
        """Run one step; waits while another thread runs one."""
        with self._cv:
            while self._stepping:
                self._cv.wait()
            self._stepping = True
        return self._step_and_release()

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
            batch = self._step_and_release()
            if not batch.requests and not batch.finished and not until():
                raise RuntimeError("the scheduler has nothing to run for the awaited request")

    def _step_and_release(self) -> Batch:
        try:
            return self._step()
        finally:
            with self._cv:
                self._stepping = False
                self._cv.notify_all()

    def _step(self) -> Batch:
        batch = Batch()
        while self._inbox:
            self.waiting.append(self._inbox.popleft())
        self._cancel_requested(batch)
        self._admit(batch)
        self._collect(batch)
        if batch.requests:
            self._run(batch)
        self._retire(batch)
        return batch

    # -- the parts of a step ---------------------------------------------------------------------
    def _cancel_requested(self, batch: Batch) -> None:
        for r in [r for r in self.waiting if r.cancel_requested]:
            self.waiting.remove(r)
            r.state = RequestState.CANCELLED
            batch.finished.append(r)
        for r in self.running:
            if r.cancel_requested:
                r.turn.finish("cancelled")

    def _admit(self, batch: Batch) -> None:
        """Open the turns of waiting requests in arrival order; a session runs one request at a time."""
        held: set = set()  # sessions with an earlier request still waiting
        still: deque[Request] = deque()
        for r in self.waiting:
            s = r.session
            if len(self.running) >= self.config.max_running or s.active is not None or s in held:
                held.add(s)
                still.append(r)
                continue
            try:
                r.turn = SteppedTurn(s, r.agent, r.params, forced=r.forced)
            except OutOfBlocksError as exc:  # transient: wait for running requests to free blocks
                if not self.running:
                    self._fail(r, exc, batch)
                    continue
                held.add(s)
                still.append(r)
                continue
            except Exception as exc:
                self._fail(r, exc, batch)
                continue
            r.state, s.active = RequestState.RUNNING, r
            self.running.append(r)
        self.waiting = still

    def _collect(self, batch: Batch) -> None:
        """Every decode token and post-turn pass, then prefill chunks in arrival order within the budget."""
        budget = self.config.max_step_tokens
        blocks = self.pool.allocator.num_available if self.pool is not None else None
        decoding = [r for r in self.running if r.turn.phase in (TurnPhase.DECODE, TurnPhase.POST)]
        prefilling = [r for r in self.running if r.turn.phase is TurnPhase.PREFILL]
        for r in decoding + prefilling:
            take = None
            if r.turn.phase is TurnPhase.PREFILL and budget is not None:
                if budget <= 0:
                    continue
                take = min(budget, r.turn.prefill_left)
            try:
                plans = r.turn.plans(take)
            except Exception as exc:
                self._fail(r, exc, batch)
                continue
            if blocks is not None:
                need = blocks_needed(plans)
                if need > blocks and batch.requests:
                    continue  # waits for a step with room (plans are recomputed then)
                blocks -= need
            if take is not None:
                budget -= take
            batch.requests.append(r)
            batch.plans.append(plans)

    def _run(self, batch: Batch) -> None:
        try:
            logits = self.forward([p for plans in batch.plans for p in plans])
        except Exception as exc:
            if isinstance(exc, OutOfBlocksError):  # expected under memory pressure: the request says why
                logger.info("the block pool is full (%s); failing %d requests", exc, len(batch.requests))
            elif isinstance(exc, PrecacheError):
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
                sampled = r.turn.advance(first)
            except Exception as exc:
                logger.exception("sampling failed for request %d", r.id)
                self._fail(r, exc, batch)
                continue
            if sampled is not None:
                r.chunks.append(StreamChunk(*sampled))

    def _retire(self, batch: Batch) -> None:
        """Finish the requests whose turn and post-turn pass are over."""
        for r in [r for r in self.running if r.turn.phase is TurnPhase.DONE]:
            self.running.remove(r)
            r.result = r.turn.record()
            r.session.active, r.session.last_turn = None, r.result
            r.state = RequestState.CANCELLED if r.turn.finish_reason == "cancelled" else RequestState.FINISHED
            batch.finished.append(r)

    def _fail(self, request: Request, error: BaseException, batch: Batch) -> None:
        """End ``request`` with ``error``; an open turn is closed without its post-turn pass (the
        session's caches may be half-written by a failed forward)."""
        if request in self.running:
            self.running.remove(request)
        if request.turn is not None:
            request.turn.abort("error")
        if request.session.active is request:
            request.session.active = None
        request.error, request.state = error, RequestState.FAILED
        batch.finished.append(request)


def run_concurrently(
    fn: Callable[[T], R], items: Iterable[T], concurrency: int = 1, desc: str | None = None
) -> list[R]:
    """``[fn(item) for item in items]`` on ``concurrency`` threads, results in the order of ``items``,
    with a progress bar when ``desc`` is given (on a terminal: :func:`precache.terminal.progress`).
    Threads whose ``fn`` waits on engine requests drive the engine's steps together, so their
    forwards are batched (:meth:`Scheduler.drive`);
    ``concurrency=1`` runs in the calling thread. The first exception is raised once the started
    items are over (the others are not started).

    Raises:
        ValueError: ``concurrency < 1``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    items = list(items)
    with progress(len(items), desc) as advance:
        if concurrency == 1:
            out = []
            for item in items:
                out.append(fn(item))
                advance()
            return out
        with ThreadPoolExecutor(min(concurrency, max(len(items), 1)), thread_name_prefix="precache") as pool:
            futures = [pool.submit(fn, item) for item in items]
            error: BaseException | None = None
            for future in as_completed(futures):
                advance()
                if error is None and not future.cancelled() and future.exception() is not None:
                    error = future.exception()
                    for f in futures:
                        f.cancel()
        if error is not None:
            raise error
        return [f.result() for f in futures]
