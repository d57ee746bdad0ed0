"""The server loop: one background thread that turns HTTP jobs into engine requests, calls
:meth:`Engine.step` (continuous batching lives in :mod:`precache.engine.scheduler`), relays each
request's tokens and final turn to its handler, and maps typed errors to HTTP status codes.

It owns the sessions (:class:`SessionPool`): claiming, syncing and releasing them happens on this
thread, between steps. A turn's answer goes out when the turn closes; its session is released once
the post-turn pass (ReBaseShared LP's neutral prefill, in a later forward) ran. A job with ``n > 1``
choices runs choice 0 on the conversation's session; once it is over, choices 1..n-1 run at once on
forks of its prompt (:meth:`Session.fork`: the prompt's cache blocks are shared, so the prompt is
prefilled once; each fork recomputes only the prompt's last token), and the forks are closed after.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace

from precache.engine.request import Request, RequestState
from precache.engine.scheduler import SchedulerConfig
from precache.engine.session import Session
from precache.errors import CacheCapacityError, OutOfBlocksError, PrecacheError, RequestCancelledError
from precache.server.config import ServerConfig
from precache.server.errors import APIError
from precache.server.jobs import ChoiceEnd, Delta, ErrorEvent, Job, finish_reason
from precache.server.metrics import ServerMetrics
from precache.server.sessions import Claim, SessionPool

logger = logging.getLogger(__name__)


def error_status(exc: BaseException) -> tuple[int, str, str]:
    """``(HTTP status, message, code)`` of an error below ``server/``: bad input is 400, a pool
    that is full right now 503, anything else (a bug) 500."""
    if isinstance(exc, OutOfBlocksError | RequestCancelledError):
        return 503, str(exc), "unavailable"
    if isinstance(exc, CacheCapacityError):
        return 400, str(exc), "cache_capacity"
    if isinstance(exc, PrecacheError):
        return 400, str(exc), "invalid_request"
    return 500, f"internal error: {type(exc).__name__}", "internal_error"


@dataclass(eq=False)
class _Active:
    """One choice of a job: choice 0 holds the pool's ``claim``; the others a ``fork`` of its prompt."""

    job: Job
    claim: Claim
    request: Request
    index: int = 0
    fork: Session | None = None
    first_token_s: float | None = None
    reported: bool = False  # the final event went out (or the client left: nothing to send)


class Scheduler:
    """The server's side of the engine scheduler, and the only thread that steps the engine (whose
    batching limits it sets from ``config.max_running`` and ``config.max_step_tokens``).

    Handlers talk to it through a thread-safe inbox: :meth:`submit`, :meth:`cancel` and
    :meth:`call` (run a function on the pool between steps, e.g. integrity checks).
    """

    def __init__(self, engine, config: ServerConfig, metrics: ServerMetrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        engine.scheduler.config = SchedulerConfig(config.max_running, config.max_step_tokens)
        self.pool = SessionPool(engine, config.max_cache_bytes, config.min_fork_tokens)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[Job] = []  # waiting for their conversation's session
        self._active: list[_Active] = []  # with an engine request, until its session is released
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the handlers' side (any thread) -----------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="precache-server-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fail what is left with 503 and end the thread."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def load(self) -> tuple[int, int]:
        """``(active, pending)`` jobs: with an engine request (post-turn passes included), or waiting
        for their session (exact when called through :meth:`call`)."""
        return len(self._active), len(self._pending)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (bound to an event loop). Raises APIError 503 when the loop is down."""
        if not self.alive:
            raise APIError(503, "the scheduler is not running", code="unavailable")
        self._inbox.put(("submit", job))

    def cancel(self, job_id: int) -> None:
        """Drop a job (client gone): a running turn closes at its next step and its session is freed."""
        self._inbox.put(("cancel", job_id))

    def call(self, fn: Callable[[SessionPool], object]) -> Future:
        """Run ``fn(pool)`` on the loop thread between two steps; its result lands in the future."""
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        return future

    # -- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._admit()
                if self.engine.scheduler.has_work:
                    batch = self.engine.step()
                    if batch.requests:
                        self.metrics.batch_requests.observe(len(batch.requests))
                self._relay()
                self._drain(block=not self._active and not self._pending)
            except Exception:  # a bug must not kill the server: fail what runs, keep serving
                logger.exception("server loop step failed")
                for active in list(self._active):
                    self._fail(active, 500, "internal error in the scheduler", "internal_error")
        for job in [*self._pending, *(a.job for a in self._active)]:
            job.emit(ErrorEvent(503, "the server is shutting down", "unavailable"))

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while msg is not None:
            kind, arg = msg
            if kind == "submit":
                self._pending.append(arg)
            elif kind == "cancel":
                self._cancel(arg)
            else:
                fn, future = arg
                try:
                    future.set_result(fn(self.pool))
                except Exception as exc:
                    future.set_exception(exc)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, job_id: int) -> None:
        self._pending = [j for j in self._pending if j.id != job_id]
        counted = False
        for active in self._active:
            if active.job.id == job_id:
                active.job.dropped = True  # no further choices start
            if active.job.id == job_id and not active.reported:
                active.reported = True
                self.engine.cancel(active.request)
                if not counted:
                    self.metrics.requests.labels("cancelled").inc()
                    counted = True

    def _admit(self) -> None:
        """Claim each pending job's session and submit its turn to the engine (a job whose
        conversation's session is busy waits for it)."""
        pending: list[Job] = []
        for job in self._pending:
            try:
                claim = self.pool.acquire(job.prompt_ids, job.session_id, job.tenant)
            except PrecacheError as exc:
                job.emit(ErrorEvent(*error_status(exc)))
                continue
            if claim is None:
                pending.append(job)
                continue
            try:
                request = claim.entry.session.submit(job.agent, **asdict(job.params))
            except PrecacheError as exc:
                self.pool.release(claim.entry)
                job.emit(ErrorEvent(*error_status(exc)))
                continue
            self._active.append(_Active(job, claim, request))
        self._pending = pending
        self.metrics.waiting.set(len(pending) + len(self.engine.scheduler.waiting))

    def _relay(self) -> None:
        """Send each request's new tokens and, once its turn closed, the turn; release the sessions
        of finished requests; evict idle sessions over the budget."""
        for active in list(self._active):
            request = active.request
            while request.chunks:
                chunk = request.chunks.popleft()
                if active.reported:
                    continue
                if active.first_token_s is None:
                    active.first_token_s = time.perf_counter()
                    if active.index == 0:
                        self.metrics.ttft.labels(active.job.model).observe(
                            active.first_token_s - active.job.arrival
                        )
                active.job.emit(Delta(active.index, chunk))
            if request.state is RequestState.FAILED:
                self._failed(active)
                continue
            if request.closed and not active.reported:
                self._report(active)
            if request.finished:
                self._active.remove(active)
                if active.fork is not None:
                    active.fork.close()
                    continue
                if request.state is RequestState.FINISHED and active.job.n > 1 and not active.job.dropped:
                    self._fork_choices(active)
                self.pool.release(active.claim.entry)
        self.metrics.running.set(len(self.engine.scheduler.running))
        self.pool.evict()
        self.metrics.cache_bytes.set(self.pool.total_bytes())
        self.metrics.pool_usage(self.engine.cache_usage())
        self.metrics.sessions.set(len(self.pool))

    def _report(self, active: _Active) -> None:
        active.reported = True
        job, request = active.job, active.request
        turn = request.result if request.result is not None else request.turn.record()
        if active.index == 0:  # the request once (its prompt, its latency)
            self.metrics.finished(
                job.model,
                time.perf_counter() - job.arrival,
                turn.prompt_tokens,
                turn.cached_tokens,
                turn.new_tokens,
                finish_reason(turn),
            )
        else:
            self.metrics.generation_tokens.inc(turn.new_tokens)
        job.emit(ChoiceEnd(active.index, turn))

    def _fork_choices(self, first: _Active) -> None:
        """Choices 1..n-1 of ``first``'s job on forks of its session's prompt (choice ``i`` samples
        with ``seed + i`` when the request has a seed)."""
        job = first.job
        parent = first.claim.entry.session
        for index in range(1, job.n):
            fork = parent.fork(len(job.prompt_ids))
            params = (
                job.params if job.params.seed is None else replace(job.params, seed=job.params.seed + index)
            )
            try:
                request = fork.submit(job.agent, **asdict(params))
            except PrecacheError as exc:
                fork.close()
                self._send_error(first, *error_status(exc))
                return
            self._active.append(_Active(job, first.claim, request, index=index, fork=fork))

    def _failed(self, active: _Active) -> None:
        """The engine failed ``active``'s request. A full block pool (nothing streamed yet) evicts the
        least recently used idle session, or waits for the other running requests, and queues the
        job again; other errors go to the client."""
        request = active.request
        self._active.remove(active)
        if active.fork is not None:
            active.fork.close()
            self._send_error(active, *error_status(request.error))
            return
        if request.turn is None:  # refused before its turn opened: the caches are untouched
            self.pool.release(active.claim.entry)
        else:
            self.pool.discard(active.claim.entry)  # its caches may be half-written
        unseen = active.first_token_s is None or not active.job.stream  # the client saw no token
        retry = isinstance(request.error, OutOfBlocksError) and unseen
        if retry and not active.reported and (self.pool.drop_idle() or self._active):
            # Preempted before the client saw a token: its blocks are back in the pool, so the
            # running requests go on, and the job starts again from its prompt once they free
            # blocks (recompute preemption, as vLLM does). With nothing else running it could
            # never fit: an error.
            self._pending.insert(0, active.job)
            return
        self._send_error(active, *error_status(request.error))

    def _send_error(self, active: _Active, status: int, message: str, code: str) -> None:
        """End ``active``'s job with an error: one event to the client, its other choices cancelled."""
        job = active.job
        over = job.dropped or (active.reported and job.n == 1)  # nothing more to tell the client
        job.dropped = True
        if over:
            return
        job.emit(ErrorEvent(status, message, code))
        self.metrics.requests.labels("error").inc()
        for other in self._active:
            if other.job is job and not other.reported:
                other.reported = True
                self.engine.cancel(other.request)
        active.reported = True

    def _fail(self, active: _Active, status: int, message: str, code: str) -> None:
        self._send_error(active, status, message, code)
        if active in self._active:
            self._active.remove(active)
        if not active.request.finished:
            self.engine.cancel(active.request)
        if active.fork is not None:
            if active.fork.active is None:
                active.fork.close()
            return
        self.pool.discard(active.claim.entry)  # its caches may be half-written
