"""Continuous batching: a background thread that, each step, runs the prefill chunks and decode
tokens of every active request (different sessions, different adapters) as ONE mixed-adapter
forward (:func:`~precache.cache.plan.run_plans`), samples per request and streams tokens out.

ReBaseShared DB's adapter-free row comes from ``method.plans`` and so rides in the same batch;
LP's post-turn neutral pass joins a later batch, after the answer went out (outside TTFT).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass

from precache.cache.plan import run_plans
from precache.engine.turn import DECODE, DONE, POST, PREFILL, SteppedTurn
from precache.errors import PrecacheError
from precache.server.config import ServerConfig
from precache.server.errors import APIError
from precache.server.jobs import DoneEvent, ErrorEvent, Job, TokenEvent
from precache.server.metrics import ServerMetrics
from precache.server.sessions import Claim, SessionPool

logger = logging.getLogger(__name__)


@dataclass
class _Active:
    job: Job
    claim: Claim
    turn: SteppedTurn
    first_token_s: float | None = None
    reported: bool = False  # the DoneEvent went out (or the client left: nothing to send)


class Scheduler:
    """Owns the sessions (:class:`SessionPool`) and the only thread that touches caches or the model.

    Handlers talk to it through a thread-safe inbox: :meth:`submit`, :meth:`cancel` and
    :meth:`call` (run a function on the pool between steps, e.g. integrity checks).
    """

    def __init__(self, engine, config: ServerConfig, metrics: ServerMetrics, codec):
        self.engine, self.config, self.metrics, self.codec = engine, config, metrics, codec
        self.pool = SessionPool(engine, config.max_cache_bytes, config.min_fork_tokens)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: list[Job] = []
        self._running: list[_Active] = []
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the handlers' side (any thread) -----------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="precache-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fail what is left with 503 and end the thread."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def load(self) -> tuple[int, int]:
        """``(running, waiting)`` requests (exact when called through :meth:`call`)."""
        return len(self._running), len(self._waiting)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (bound to an event loop). Raises APIError 503 when the scheduler is down."""
        if not self.alive:
            raise APIError(503, "the scheduler is not running", code="unavailable")
        self._inbox.put(("submit", job))

    def cancel(self, job_id: int) -> None:
        """Drop a job (client gone): a running turn closes at once and its session is freed."""
        self._inbox.put(("cancel", job_id))

    def call(self, fn: Callable[[SessionPool], object]) -> Future:
        """Run ``fn(pool)`` on the scheduler thread between two steps; its result lands in the future."""
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        return future

    # -- the scheduler thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._retire()
                self._admit()
                if self._running:
                    self._step()
                self._drain(block=not self._running)
            except Exception:  # a bug must not kill the server: fail the batch, keep serving
                logger.exception("scheduler step failed")
                for active in list(self._running):
                    self._fail(active, 500, "internal error in the scheduler")
        for job in [*self._waiting, *(a.job for a in self._running)]:
            job.emit(ErrorEvent(503, "the server is shutting down", "unavailable"))

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while msg is not None:
            kind, arg = msg
            if kind == "submit":
                self._waiting.append(arg)
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
        self._waiting = [j for j in self._waiting if j.id != job_id]
        for active in self._running:
            if active.job.id == job_id and not active.reported:
                active.reported = True
                active.turn.finish("cancelled")
                self.metrics.requests.labels("cancelled").inc()

    def _admit(self) -> None:
        waiting: list[Job] = []
        for job in self._waiting:
            if len(self._running) >= self.config.max_running:
                waiting.append(job)
                continue
            try:
                claim = self.pool.acquire(job.prompt_ids, job.session_id)
            except PrecacheError as exc:
                job.emit(ErrorEvent(400, str(exc), "invalid_request"))
                continue
            if claim is None:  # its conversation's session is busy: run after it
                waiting.append(job)
                continue
            session = claim.entry.session
            try:
                params = session.validate(job.agent, asdict(job.params))
                turn = SteppedTurn(session, job.agent, params, self.codec)
            except PrecacheError as exc:
                self.pool.release(claim.entry)
                job.emit(ErrorEvent(400, str(exc), "invalid_request"))
                continue
            except Exception:
                logger.exception("opening a turn failed for request %d", job.id)
                self.pool.discard(claim.entry)
                job.emit(ErrorEvent(500, "opening the turn failed", "internal_error"))
                continue
            self._running.append(_Active(job, claim, turn))
        self._waiting = waiting
        self.metrics.waiting.set(len(waiting))
        self.metrics.running.set(len(self._running))

    def _collect(self) -> list[tuple[_Active, list]]:
        """This step's rows: every decode token and post-turn pass, then prefill chunks in arrival
        order within ``max_step_tokens``."""
        batch = [(a, a.turn.plans(0)) for a in self._running if a.turn.phase in (DECODE, POST)]
        budget = self.config.max_step_tokens
        for a in self._running:
            if a.turn.phase == PREFILL and budget > 0:
                take = min(budget, a.turn.prefill_left)
                batch.append((a, a.turn.plans(take)))
                budget -= take
        return batch

    def _step(self) -> None:
        batch = self._collect()
        self.metrics.batch_requests.observe(len(batch))
        try:
            logits = run_plans(self.engine.model, [p for _, plans in batch for p in plans])
        except Exception:
            logger.exception("a batched forward failed; failing its %d requests", len(batch))
            for active, _ in batch:
                self._fail(active, 500, "the model forward failed")
            return
        i = 0
        for active, plans in batch:
            self._advance(active, logits[i])
            i += len(plans)
            s = active.claim.entry.session
            s.peak_bytes = max(s.peak_bytes, s.cache_bytes()["total"])
        self._retire()
        self.metrics.running.set(len(self._running))
        self.pool.evict()
        self.metrics.cache_bytes.set(self.pool.total_bytes())
        self.metrics.sessions.set(len(self.pool))

    def _advance(self, active: _Active, logits) -> None:
        try:
            sampled = active.turn.advance(logits)
        except Exception:
            logger.exception("sampling failed for request %d", active.job.id)
            self._fail(active, 500, "sampling failed")
            return
        if sampled is not None and not active.reported:
            if active.first_token_s is None:
                active.first_token_s = time.perf_counter()
                self.metrics.ttft.labels(active.job.model).observe(active.first_token_s - active.job.arrival)
            active.job.emit(TokenEvent(*sampled))
        if active.turn.phase in (POST, DONE) and not active.reported:
            self._report(active)

    def _report(self, active: _Active) -> None:
        active.reported = True
        job, turn = active.job, active.turn
        reason = "length" if turn.finish_reason == "length" else "stop"
        done = DoneEvent(
            reason,
            len(job.prompt_ids),
            turn.cached_tokens,
            len(turn.out),
            active.claim.entry.sid,
            tuple(turn.out),
        )
        self.metrics.finished(
            job.model,
            time.perf_counter() - job.arrival,
            done.prompt_tokens,
            done.cached_tokens,
            done.completion_tokens,
            reason,
        )
        job.emit(done)

    def _retire(self) -> None:
        """Free the sessions of finished turns (after their post-turn pass ran)."""
        for active in [a for a in self._running if a.turn.phase == DONE]:
            self._running.remove(active)
            self.pool.release(active.claim.entry)

    def _fail(self, active: _Active, status: int, message: str) -> None:
        if not active.reported:
            active.reported = True
            active.job.emit(ErrorEvent(status, message, "internal_error"))
            self.metrics.requests.labels("error").inc()
        if active in self._running:
            self._running.remove(active)
        self.pool.discard(active.claim.entry)  # its caches may be half-written
