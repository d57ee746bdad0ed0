"""The server loop: one background thread that moves jobs in and events out. It claims each job's
session, submits one engine request (whose ``n`` choices the engine samples alongside), calls
:meth:`Engine.step` and relays each choice's tokens and final turn to the job's handler. It has
no scheduling policy of its own: admission, chunked prefill, preemption and parallel sampling are
the engine's (:mod:`precache.engine.scheduler`); when the engine needs blocks, it asks this loop's
session pool to drop idle conversations first (:meth:`SessionPool.reclaim`). Typed errors below
the server become HTTP status codes here (:func:`error_status`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from precache.engine.request import Request, RequestState
from precache.errors import (
    AdapterBusyError,
    CacheCapacityError,
    OutOfBlocksError,
    PrecacheError,
    RequestCancelledError,
)
from precache.server.config import ServerConfig
from precache.server.errors import APIError
from precache.server.jobs import ErrorEvent, Job, finish_reason
from precache.server.metrics import ServerMetrics
from precache.server.sessions import SessionPool

logger = logging.getLogger(__name__)


def error_status(exc: BaseException) -> tuple[int, str, str]:
    """``(HTTP status, message, code)`` of an error below ``server/``: bad input is 400, a pool
    that cannot hold the request now 503, anything else (a bug) 500."""
    if isinstance(exc, OutOfBlocksError | RequestCancelledError):
        return 503, str(exc), "unavailable"
    if isinstance(exc, CacheCapacityError):
        return 400, str(exc), "cache_capacity"
    if isinstance(exc, PrecacheError):
        return 400, str(exc), "invalid_request"
    return 500, f"internal error: {type(exc).__name__}", "internal_error"


class ServerLoop:
    """The only thread that steps the engine (its batching limits set from ``config.max_running``
    and ``config.max_step_tokens``) and touches the sessions. Handlers talk to it through a
    thread-safe inbox: :meth:`submit`, :meth:`cancel` and :meth:`call` (run a function on the
    session pool between steps, e.g. integrity checks)."""

    def __init__(self, engine, config: ServerConfig, metrics: ServerMetrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        engine.configure(max_running=config.max_running, max_step_tokens=config.max_step_tokens)
        self.pool = SessionPool(engine, config.min_fork_tokens)
        engine.set_idle_reclaim(self.pool.reclaim)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[Job] = []  # waiting for their conversation's session
        self._jobs: list[Job] = []  # with an engine request, until it and its choices are over
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: set when the server starts draining (``/health`` says so, new requests get 503)
        self.draining = False
        # jobs submitted (by the handlers' thread) and ended (by the loop's): one writer each
        self._submitted = self._ended = 0

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

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet over (queued, waiting for their session, or in the engine)."""
        return self._submitted - self._ended

    def load(self) -> tuple[int, int]:
        """``(active, pending)`` jobs: with an engine request (post-turn passes included), or waiting
        for their session (exact when called through :meth:`call`)."""
        return len(self._jobs), len(self._pending)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (bound to an event loop). Raises APIError 503 when the loop is down."""
        if not self.alive:
            raise APIError(503, "the server loop is not running", code="unavailable")
        self._submitted += 1
        self._inbox.put(("submit", job))

    def cancel(self, job_id: int) -> None:
        """Drop a job (client gone): its turn and choices close at the next step."""
        self._inbox.put(("cancel", job_id))

    def fail_all(self, status: int, message: str, code: str) -> None:
        """End every job with an :class:`ErrorEvent` (the drain time ran out): a stream sends it and
        ``[DONE]``, a waiting response becomes that error; their requests are cancelled."""
        self._inbox.put(("fail_all", (status, message, code)))

    def call(self, fn: Callable[[SessionPool], object]) -> Future:
        """Run ``fn(pool)`` on the loop thread between two steps; its result lands in the future."""
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        return future

    def release_idle(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Wait until no job is in flight (up to ``timeout_s`` seconds), drop every idle session and
        count the engine's KV blocks: ``{"blocks", "blocks_free", "sessions_left", "jobs_left"}``
        (blocks published for prefix reuse count as free). Once every session is gone, ``blocks -
        blocks_free`` blocks held by nothing have leaked: ``bench soak``'s check. Call it from any
        thread but the loop's."""
        deadline = time.monotonic() + timeout_s
        while sum(self.call(lambda _: self.load()).result(timeout_s)) and time.monotonic() < deadline:
            time.sleep(0.1)

        def drop(pool: SessionPool) -> dict[str, int]:
            pool.reclaim(10**9)
            allocator = pool.engine.pool.allocator
            active, pending = self.load()
            return {
                "blocks": allocator.num_blocks,
                "blocks_free": allocator.num_available,
                "sessions_left": len(pool.entries),
                "jobs_left": active + pending,
            }

        return self.call(drop).result(timeout_s)

    def remove_adapter(self, name: str) -> None:
        """Unload adapter ``name`` on the loop thread, after every job queued before this call was
        taken in (any thread; waits for the answer).

        Raises:
            UnknownAdapterError: ``name`` is not loaded.
            AdapterBusyError: a job of it is waiting here or in the engine.
        """

        def remove(_pool: SessionPool) -> None:
            waiting = sum(1 for job in self._pending if job.agent == name)
            if waiting:
                raise AdapterBusyError(f"adapter '{name}' is used by {waiting} queued request(s)")
            self.engine.remove_adapter(name)

        self.call(remove).result()

    # -- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._admit()
                self._flow_control()
                ran = False
                if self.engine.has_work:
                    batch = self.engine.step()
                    ran = bool(batch.requests or batch.finished or batch.preempted)
                    if batch.requests:
                        self.metrics.batch_requests.observe(len(batch.requests))
                self._relay()
                # nothing ran (every request held for its reader): wait for the inbox a moment
                idle = not self._jobs and not self._pending
                self._drain(block=idle or not ran, timeout_s=0.5 if idle else 0.02)
            except Exception:  # a bug must not kill the server: fail what runs, keep serving
                logger.exception("server loop step failed")
                for job in list(self._jobs):
                    self._abandon(job, 500, "internal error in the server loop", "internal_error")
        for job in [*self._pending, *self._jobs]:
            job.emit(ErrorEvent(503, "the server is shutting down", "unavailable"))

    def _drain(self, block: bool, timeout_s: float = 0.5) -> None:
        try:
            msg = self._inbox.get(timeout=timeout_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while msg is not None:
            kind, arg = msg
            if kind == "submit":
                self._pending.append(arg)
            elif kind == "cancel":
                self._cancel(arg)
            elif kind == "fail_all":
                self._fail_all(*arg)
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
        kept = [j for j in self._pending if j.id != job_id]
        self._ended += len(self._pending) - len(kept)
        self._pending = kept
        for job in self._jobs:
            if job.id == job_id and not job.dropped:
                job.dropped = True
                self.engine.cancel(job.request)
                self.metrics.requests.labels("cancelled").inc()

    def _fail_all(self, status: int, message: str, code: str) -> None:
        for job in self._pending:
            job.emit(ErrorEvent(status, message, code))
            self.metrics.error(status, code)
        self._ended += len(self._pending)
        self._pending = []
        for job in self._jobs:
            if not job.dropped:
                self.metrics.error(status, code)
            self._send_error(job, status, message, code)

    def _flow_control(self) -> None:
        """Hold a request whose client stopped reading (more than ``stream_buffer_events`` events
        wait for it) out of the batch, its blocks kept; let it go on once half are read; cancel it
        once held for ``stream_stall_timeout_s`` (408 ``stream_stalled``)."""
        limit, now, held = self.config.stream_buffer_events, time.monotonic(), 0
        for job in list(self._jobs):
            flow = job.flow
            if job.dropped:  # cancelled or failed: its turn closes (and its post-turn pass runs)
                flow.held_since = None
            elif flow.held_since is None and flow.backlog >= limit:
                flow.held_since = now
                self.metrics.streams_held.inc()
                logger.info(
                    "request %d held: %d events wait for a client that stopped reading", job.id, flow.backlog
                )
            elif flow.held_since is not None and flow.backlog <= limit // 2:
                flow.held_since = None
            elif flow.held_since is not None and now - flow.held_since > self.config.stream_stall_timeout_s:
                self.metrics.refused.labels("stream_stalled").inc()
                message = (
                    f"the client did not read its stream for {self.config.stream_stall_timeout_s:g} s ("
                    f"{flow.backlog} events waiting): the request was cancelled"
                )
                self._send_error(job, 408, message, "stream_stalled")
                flow.held_since = None
            for request in (job.request, *job.request.children):
                request.held = flow.held_since is not None
            held += flow.held_since is not None
        self.metrics.held.set(held)

    def _admit(self) -> None:
        """Claim each pending job's session and submit its request to the engine (a job whose
        conversation's session is busy waits for it)."""
        pending: list[Job] = []
        for job in self._pending:
            try:
                entry = self.pool.acquire(job.prompt_ids, job.session_id, job.tenant)
                if entry is None:
                    pending.append(job)
                    continue
                job.entry = entry
                # the handler checked the body once (adapter, fields, token ids, context)
                job.request = self.engine.submit(Request(entry.session, job.agent, job.params))
            except PrecacheError as exc:
                if job.entry is not None:
                    self.pool.release(job.entry)
                job.emit(ErrorEvent(*error_status(exc)))
                self._ended += 1
                continue
            self._jobs.append(job)
        self._pending = pending
        self.metrics.waiting.set(len(pending) + self.engine.num_waiting)

    def _relay(self) -> None:
        """Send each choice's new tokens and, once its turn closed, the turn; end the jobs whose
        request and choices are over."""
        for job in list(self._jobs):
            for request in (job.request, *job.request.children):
                self._relay_choice(job, request)
            if job.request.all_finished:
                self._end(job)
        self.metrics.running.set(self.engine.num_running)
        usage = self.engine.cache_usage()
        self.metrics.cache_bytes.set(usage["allocated"])
        self.metrics.pool_usage(usage)
        self.metrics.swap_usage(self.engine.swap_usage())
        self.metrics.sessions.set(len(self.pool))

    def _relay_choice(self, job: Job, request) -> None:
        while request.chunks:
            chunk = request.chunks.popleft()
            if job.dropped:
                continue
            if job.first_token_s is None:
                job.first_token_s = time.perf_counter()
                self.metrics.ttft.labels(job.model).observe(job.first_token_s - job.arrival)
            job.emit(chunk)
        if request.state is RequestState.FAILED:
            self._send_error(job, *error_status(request.error))
        elif request.closed and request.index not in job.reported:
            job.reported.add(request.index)
            turn = request.result if request.result is not None else request.record()
            if job.dropped:
                return
            if request.index == 0:  # the request once (its prompt, its latency)
                latency = time.perf_counter() - job.arrival
                tokens = (turn.prompt_tokens, turn.cached_tokens, turn.new_tokens)
                self.metrics.finished(job.model, latency, *tokens, finish_reason(turn))
            else:
                self.metrics.generation_tokens.inc(turn.new_tokens)
            job.emit(turn)

    def _end(self, job: Job) -> None:
        """The job's request and choices are over: close the choices' forks, release the session
        (or drop it when a failed forward may have half-written its caches)."""
        self._jobs.remove(job)
        self._ended += 1
        for child in job.request.children:
            child.session.close()
        if job.request.state is RequestState.FAILED and job.request.phase is not None:
            self.pool.discard(job.entry)
        else:
            self.pool.release(job.entry)

    def _send_error(self, job: Job, status: int, message: str, code: str) -> None:
        """End ``job`` with an error: one event to the client, its other choices cancelled."""
        if job.dropped:
            return
        job.dropped = True
        job.emit(ErrorEvent(status, message, code))
        self.metrics.requests.labels("error").inc()
        self.engine.cancel(job.request)

    def _abandon(self, job: Job, status: int, message: str, code: str) -> None:
        """After a bug in the loop: tell the client, stop the request, drop its session."""
        self._send_error(job, status, message, code)
        self._jobs.remove(job)
        self._ended += 1
        self.engine.cancel(job.request)
        self.pool.discard(job.entry)
