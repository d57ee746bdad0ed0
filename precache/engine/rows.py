"""Which rows a step runs: the running requests (:class:`RunningSet`) and the step's budget
(:class:`StepBudget`).

A decoding request adds one token, a closed turn its post-turn pass (ReBaseShared LP's neutral
prefill); neither counts against the step's prefill budget. A prefilling request adds the next
chunk of its prompt, at most what is left of ``max_step_tokens`` (chunked prefill, as vLLM's).
Every request's rows go in only while the blocks they write fit what the pool can hand out (free
or evictable); a request whose rows do not fit makes room
(:class:`~precache.engine.preemption.Preemption`) or waits a step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from precache.cache.plan import blocks_needed, reserve_writes
from precache.cache.pool import KVPool
from precache.engine.request import Phase, Request, RequestState
from precache.engine.swap_space import SwapSpace
from precache.errors import OutOfBlocksError


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


def out_of_blocks(request: Request, need: int, available: int, pool: KVPool) -> OutOfBlocksError:
    """The error of a request that cannot fit even with no other request running."""
    return OutOfBlocksError(
        f"request {request.id} needs {need} more KV-cache blocks and only {available} can be handed "
        f"out with no other request running: idle sessions hold the rest (close them) or raise "
        f"kv_cache_bytes (the pool has {pool.num_blocks} blocks)"
    )


class RunningSet:
    """The running requests of one engine, oldest first (``requests``; a preempted one leaves it
    until it resumes), and how one ends: retired when its turn and post-turn pass are over, failed
    on an error. ``swap_space`` holds the caches a failed request never got back."""

    def __init__(self, swap_space: SwapSpace):
        self.requests: list[Request] = []
        self.swap_space = swap_space

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        bisect.insort(self.requests, request, key=lambda r: r.priority)

    def remove(self, request: Request) -> None:
        self.requests.remove(request)

    def close_cancelled(self) -> None:
        """Close the turns of running requests whose cancel was asked (their tokens so far stay)."""
        for r in self.requests:
            if r.cancel_requested:
                r.finish("cancelled")

    def schedule(self, step: StepBudget) -> None:
        """Every running request's rows, oldest first, making room by preempting younger ones; a
        held request (``Request.held``) sits this step out."""
        for r in list(self.requests):
            # not preempted earlier in this loop, nor closed (a cancelled turn with no post-turn
            # pass is DONE: it retires this step and runs no more rows), nor held
            if r.state is RequestState.RUNNING and r.phase is not Phase.DONE and not r.held:
                step.take(r, preempt=True)

    def youngest(self, than: Request, scheduled: set[int]) -> Request | None:
        """The youngest running request younger than ``than`` and not in this step's batch (ids in
        ``scheduled``), or None: the next to preempt."""
        younger = [r for r in self.requests if r.priority > than.priority and r.id not in scheduled]
        return max(younger, key=lambda r: r.priority, default=None)

    def retire(self, batch: Batch) -> None:
        """Finish the requests whose turn and post-turn pass are over."""
        for r in [r for r in self.requests if r.phase is Phase.DONE]:
            self.requests.remove(r)
            r.complete()
            batch.finished.append(r)

    def fail(self, request: Request, error: BaseException, batch: Batch) -> None:
        """End ``request`` with ``error``; an open turn is closed without its post-turn pass (the
        session's caches may be half-written by a failed forward)."""
        if request in self.requests:
            self.requests.remove(request)
        if request.phase is not None:
            request.abort("error")
        if request.swapped is not None:  # its caches never came back: the session starts over
            self.swap_space.forget(request.session)
            request.session.forget_caches()
        request.session.release_turn(request)
        request.error, request.state = error, RequestState.FAILED
        batch.finished.append(request)


class StepBudget:
    """One step as it is built: its ``batch``, and what it may still take: ``blocks`` of the
    ``pool`` (None: no pool) and prefill ``tokens`` (None: every prefill whole). Rows that do not
    fit ask ``make_room(short, request, batch, preempt)`` for ``short`` blocks
    (:meth:`~precache.engine.preemption.Preemption.make_room`, which returns the blocks it freed); a
    request that cannot fit even alone fails in ``running``.
    """

    def __init__(
        self,
        batch: Batch,
        pool: KVPool | None,
        max_step_tokens: int | None,
        running: RunningSet,
        make_room: Callable[[int, Request, Batch, bool], int],
    ):
        self.batch, self.pool, self.running, self._make_room = batch, pool, running, make_room
        self.blocks: int | None = pool.allocator.num_available if pool is not None else None
        self.tokens = max_step_tokens

    def prefill_take(self, request: Request) -> int | None:
        """Prompt tokens ``request`` prefills this step: None (its rows are not a prefill chunk, or
        the whole prompt when there is no budget), 0 (the budget is spent) or the chunk size."""
        if request.phase is not Phase.PREFILL or self.tokens is None:
            return None
        return max(0, min(self.tokens, request.prefill_left))

    def make_room(self, need: int, request: Request, preempt: bool) -> None:
        """Free blocks until ``need`` fit, if possible; with ``preempt``, younger running requests too."""
        self.blocks += self._make_room(need - self.blocks, request, self.batch, preempt)

    def charge_since(self, available_before: int) -> None:
        """Count the blocks taken outside a row since the pool had ``available_before`` (a swap-in, a
        rebuild, cached blocks a prefix match attached)."""
        if self.pool is not None and self.blocks is not None:
            self.blocks -= max(0, available_before - self.pool.allocator.num_available)

    def take(self, request: Request, preempt: bool) -> bool:
        """Put ``request``'s rows in the batch if their blocks fit (preempting younger requests when
        ``preempt``); False when they do not fit now (``request`` waits a step, or fails when it is
        the only request and can never fit)."""
        take = self.prefill_take(request)
        if take == 0:
            return True  # the step's prefill budget is spent: the prefill goes on next step
        try:
            plans = request.plans(take)
        except Exception as exc:
            self.running.fail(request, exc, self.batch)
            return False
        need = blocks_needed(plans) if self.pool is not None else 0
        if self.blocks is not None and need > self.blocks:
            self.make_room(need, request, preempt)
            need = blocks_needed(plans)
            if need > self.blocks:
                if not self.batch.requests and len(self.running) == 1:
                    self.running.fail(
                        request, out_of_blocks(request, need, self.blocks, self.pool), self.batch
                    )
                return False
        if self.blocks is not None:
            try:
                reserve_writes(plans)  # held from now on: nothing started later in the step takes them
            except OutOfBlocksError as exc:
                self.running.fail(request, exc, self.batch)
                return False
            self.blocks = min(self.blocks - need, self.pool.allocator.num_available)
        if take is not None and self.tokens is not None:
            self.tokens -= take
        self.batch.requests.append(request)
        self.batch.plans.append(plans)
        return True
