"""The request: one turn asked of a session, in one declared record from submission to its output
(nano-vllm's ``Sequence``): its sampling parameters, its state, where its turn stands on its
session's caches, and what it gives back (:class:`~precache.engine.outputs.StreamChunk` as tokens
come, :class:`~precache.engine.outputs.Turn` at the end); its
:class:`~precache.engine.decoding.Decoder` samples and detokenizes. The scheduler moves it
WAITING -> RUNNING as its turn opens, runs its rows (chunked prefill, then one token per step) and
ends it FINISHED, CANCELLED or FAILED once the turn and its post-turn pass ran; under memory
pressure it may be PREEMPTED (caches swapped out, :mod:`precache.engine.preemption`) and RUNNING
again later. It never writes its session's fields: it reports through
:class:`~precache.engine.lifecycle.TurnHost`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from precache.cache.rowplan import RowPlan
from precache.config import SamplingParams
from precache.engine.decoding import Decoder
from precache.engine.lifecycle import Phase, RequestState, TurnHost
from precache.engine.outputs import StreamChunk, Turn
from precache.engine.validation import check_room
from precache.errors import RequestCancelledError, UnknownAdapterError

if TYPE_CHECKING:
    from precache.cache.swap import SwappedBlocks

_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Request:
    """One turn of ``agent`` (None: base model) asked of ``session``, whose trajectory ends with the
    prompt; ``forced`` replaces sampling by these tokens (teacher forcing, logits kept).

    ``params.n > 1`` asks for parallel sampling: once the prompt is prefilled, choices 1..n-1 are
    requests of their own (``children``, built by :meth:`choice`) on forks of the session that
    share its blocks, and they decode in the same steps. ``chunks``: the sampled tokens (any thread
    may pop them); ``result`` (FINISHED or CANCELLED) or ``error`` (FAILED) at the end. ``held``:
    whoever reads ``chunks`` asked the request to wait (a server stream whose client stopped
    reading): while held, a running request takes no rows and keeps its blocks; set and cleared
    from any thread, read per step. Times: ``perf_counter`` seconds. The open turn's fields are
    set by :meth:`open`.
    """

    session: TurnHost
    agent: str | None
    params: SamplingParams
    forced: list[int] | None = None
    index: int = 0
    parent: Request | None = field(default=None, repr=False)
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.perf_counter)  # with id, its age: older goes first
    state: RequestState = RequestState.WAITING
    phase: Phase | None = None  # None until the turn opens
    cancel_requested: bool = False
    held: bool = False
    preemptions: int = 0
    budget: int = 0  # tokens it may generate: max_new_tokens within the context length
    prompt_tokens: int = 0  # the trajectory's length as the turn opened
    appended: tuple[int, ...] = field(default=(), repr=False)  # since the session's previous turn
    cached_tokens: int = 0  # the first position the turn prefills
    reread: bool = False  # all cached: the last prompt token is read again for its logits
    pos: int = 0  # the next position to prefill
    chunk_end: int = 0  # the end of the rows plans() built
    chunk_tokens: int = 0  # their prefill cost (RowPlan.prefill_cost)
    prefill_tokens: int = 0  # the prefill cost booked so far
    catch_up: list[RowPlan] = field(default_factory=list, repr=False)  # an added agent's caches
    post: list[RowPlan] = field(default_factory=list, repr=False)  # the post-turn pass
    t_open: float = 0.0
    t_first: float = 0.0  # the first token
    t_end: float = 0.0  # the turn closed
    t_done: float = 0.0  # its post-turn pass ran
    decoder: Decoder | None = field(default=None, repr=False)  # from the turn's opening on
    chunks: deque[StreamChunk] = field(default_factory=deque, repr=False)
    children: list[Request] = field(default_factory=list, repr=False)
    result: Turn | None = field(default=None, repr=False)
    error: BaseException | None = None

    @classmethod
    def choice(cls, parent: Request, session: TurnHost, index: int) -> Request:
        """Choice ``index`` of ``parent`` on ``session`` (a fork of its caches with the turn open, its
        prompt prefilled): it samples its first token from the same logits, with ``seed + index``
        when ``parent`` has a seed."""
        seed = parent.params.seed
        params = dataclasses.replace(parent.params, n=1, seed=None if seed is None else seed + index)
        child = cls(
            session,
            parent.agent,
            params,
            index=index,
            parent=parent,
            arrival=parent.arrival,
            state=RequestState.RUNNING,
            phase=Phase.DECODE,
            cancel_requested=parent.cancel_requested,
            budget=parent.budget,
            prompt_tokens=parent.prompt_tokens,
            appended=parent.appended,
            cached_tokens=parent.cached_tokens,
            reread=parent.reread,
            pos=parent.pos,
            chunk_end=parent.chunk_end,
            t_open=parent.t_open,  # the prompt was prefilled once, by choice 0: no prefill booked
            decoder=Decoder.start(session.engine, params, parent.decoder.prompt, index=index),
        )
        session.start_turn(child)
        return child

    # -- state ---------------------------------------------------------------------------------
    @property
    def priority(self) -> tuple[float, int]:
        """Older first: arrival time, then id (choices share their parent's arrival)."""
        return self.arrival, self.id

    @property
    def swapped(self) -> SwappedBlocks | None:
        """The host copies of the session's caches while they are swapped out, else None."""
        return self.session.swapped

    @property
    def finished(self) -> bool:
        """Over: the turn and its post-turn pass ran, or the request was cancelled or failed."""
        return self.state in (RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED)

    @property
    def all_finished(self) -> bool:
        """This request and every choice forked from it are over."""
        return self.finished and all(c.finished for c in self.children)

    @property
    def closed(self) -> bool:
        """Every token is out (the post-turn pass may still be running)."""
        return self.finished or self.phase in (Phase.POST, Phase.DONE)

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.session.token_ids) - self.pos if self.phase is Phase.PREFILL else 0

    @property
    def out(self) -> list[int]:
        """The token ids generated so far."""
        return self.decoder.out if self.decoder is not None else []

    def outcome(self) -> Turn:
        """The finished turn (choice 0 under parallel sampling: :meth:`outcomes` gives them all).

        Raises:
            RequestCancelledError: the request was cancelled (``exc.turn``: the tokens so far, or None).
            the request's error: it failed (a :class:`~precache.errors.PrecacheError` on bad input).
        """
        if self.state is RequestState.FAILED:
            raise self.error
        if self.state is RequestState.CANCELLED:
            raise RequestCancelledError(f"request {self.id} was cancelled", turn=self.result)
        if self.state is not RequestState.FINISHED:
            raise RuntimeError(f"request {self.id} is {self.state.value}, not finished")
        return self.result

    def outcomes(self) -> list[Turn]:
        """Every choice's turn, by index (raises as :meth:`outcome`)."""
        return [self.outcome(), *(c.outcome() for c in self.children)]

    # -- the turn ------------------------------------------------------------------------------
    def open(self) -> None:
        """Start the turn on the session's caches (between turns only): blocks other trajectories
        published for the same prefix are attached, then the method says where the prefill starts.

        Raises:
            UnknownAdapterError: the agent was unloaded since the request was queued.
            EmptyRequestError, ContextLengthError: no prompt, or no room left.
            CacheCapacityError: the turn (all ``n`` choices) could never fit the block pool.
            StructuredOutputError: the constraint does not compile.
        """
        s, params, forced = self.session, self.params, self.forced
        method = s.method
        method.sync_state(s.state)  # adapters loaded or unloaded since the last turn
        if self.agent is not None and self.agent not in method.adapters:
            raise UnknownAdapterError(f"adapter '{self.agent}' was unloaded before the request started")
        n, limit = len(s.token_ids), s.engine.max_context
        check_room(n, limit, len(forced) if forced else 0, param="token_ids")
        method.check_fits(s.state, n + (len(forced) if forced else params.max_new_tokens), choices=params.n)
        self.decoder = Decoder.start(s.engine, params, s.token_ids, forced)
        self.budget = min(params.max_new_tokens, limit - n)
        self.t_open, self.prompt_tokens = time.perf_counter(), n
        self.appended = tuple(s.token_ids[s.last_turn_end :])
        reused = method.reuse_prefix(s.state, self.agent, s.token_ids)
        s.extend_authors(None, reused)  # their authors are not ours to know
        # all cached: re-read the last prompt token for its logits, writing no cache entry (the
        # entry belongs to whoever processed the token first: DESIGN.md, "Determinism")
        self.reread = method.prefill_start(s.state, self.agent) >= n
        method.begin_turn(s.state, self.agent)
        # rows that build this agent's missing caches (an adapter added at run time), first forward
        self.catch_up = method.catch_up(s.state, self.agent, s.token_ids, s.authors)
        self.pos = self.cached_tokens = n - 1 if self.reread else method.prefill_start(s.state, self.agent)
        self.phase, self.state = Phase.PREFILL, RequestState.RUNNING
        s.start_turn(self)

    def plans(self, max_prefill: int | None = None) -> list[RowPlan]:
        """Rows for the next forward: a prefill chunk of at most ``max_prefill`` tokens (None: all;
        at least one), the last sampled token, or the post-turn plans. The first row carries the logits."""
        s, method = self.session, self.session.method
        if self.phase is Phase.POST:
            return self.post
        if self.phase is Phase.DECODE:
            pos = len(s.token_ids) - 1
            self.chunk_end = pos + 1
            return method.plans(s.state, self.agent, [s.token_ids[pos]], pos)
        left = len(s.token_ids) - self.pos
        self.chunk_end = self.pos + (left if max_prefill is None else min(left, max(1, max_prefill)))
        plans = method.plans(s.state, self.agent, s.token_ids[self.pos : self.chunk_end], self.pos)
        if self.reread:  # the agent's own row only, reading the cached entry of the token itself
            plans = [RowPlan(p.token_ids, p.pos0, p.adapter, [], p.views) for p in plans[:1]]
        plans += self.catch_up  # they write at every layer before the turn's rows read
        # counted once the forward ran; a recompute row counts its token-layers (RowPlan.prefill_cost)
        self.chunk_tokens = sum(p.prefill_cost for p in plans)
        if self.chunk_end < len(s.token_ids):  # an inner chunk: nothing to sample yet
            for plan in plans:
                plan.want_logits = False
        return plans

    def ran(self) -> bool:
        """Book the forward of :meth:`plans`; True when the request now samples a token (prefill over
        or decoding), False after an inner prefill chunk or the post-turn pass."""
        s = self.session
        s.note_cache_bytes()
        if self.phase is Phase.POST:
            self.phase, self.t_done = Phase.DONE, time.perf_counter()
            s.method.publish_prefix(s.state, s.token_ids)  # the pass completed more blocks
            return False
        s.extend_authors(self.agent, self.chunk_end)
        if self.phase is Phase.PREFILL:
            self.catch_up = []
            self.prefill_tokens += self.chunk_tokens
            self.pos = self.chunk_end
            if self.pos < len(s.token_ids):
                return False
        return True

    def sample(self, logits: torch.Tensor) -> StreamChunk:
        """Take the next token from ``logits`` ``[vocab]`` (:meth:`Decoder.step`), append it to the
        trajectory and return it with the text now safe to send; closes the turn at a stop or at
        its budget."""
        if self.phase is Phase.PREFILL:
            self.phase, self.decoder.first_logits = Phase.DECODE, logits
        chunk, reason = self.decoder.step(logits)
        self.session.add_token(chunk.token_id)
        if len(self.decoder.out) == 1:
            self.t_first = time.perf_counter()
        if reason or len(self.decoder.out) >= self.budget:
            held = self.finish(reason or "length")  # what the detokenizer and the stop rule held back
            if held:
                chunk = dataclasses.replace(chunk, text=chunk.text + held)
        self.chunks.append(chunk)
        return chunk

    def finish(self, reason: str) -> str:
        """Close the turn now (``reason``: eos, stop, length or cancelled); the tokens so far stay
        in the trajectory. Returns the text held back until now (:meth:`Decoder.close`); "" and
        nothing done when already closed."""
        if self.closed:
            return ""
        s = self.session
        self.t_end = time.perf_counter()
        held = self.decoder.close(reason)
        self.post = s.method.end_turn(s.state, self.agent, s.token_ids)
        s.close_turn()
        self.phase = Phase.POST if self.post else Phase.DONE
        if not self.post:
            self.t_done = self.t_end
        return held

    def abort(self, reason: str) -> None:
        """Close the turn and skip its post-turn pass (after a failed forward)."""
        self.finish(reason)
        self.post, self.phase = [], Phase.DONE
        self.t_done = self.t_done or time.perf_counter()

    def complete(self) -> Turn:
        """End the request once its turn and post-turn pass are over (phase DONE): its final record
        lands in ``result`` and is committed to the session, which is free again."""
        self.result = self.record()
        self.session.commit_turn(self.result)
        cancelled = self.decoder.finish_reason == "cancelled"
        self.state = RequestState.CANCELLED if cancelled else RequestState.FINISHED
        return self.result

    def record(self) -> Turn:
        """The turn so far as a :class:`~precache.engine.outputs.Turn` (its final record once DONE;
        no tokens when the turn never opened)."""
        s = self.session
        t_first = self.t_first or self.t_end
        lifecycle = {
            "agent": self.agent,
            "ttft_s": max(t_first - self.t_open, 0.0),
            "decode_s": max(self.t_end - t_first, 0.0),
            "prefill_tokens": self.prefill_tokens,
            "neutral_tokens": sum(len(p.token_ids) for p in self.post),
            "neutral_s": max(self.t_done - self.t_end, 0.0),
            "appended": self.appended,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "kv_bytes": s.cache_bytes()["total"],
            "session_id": s.id,
        }
        if self.decoder is None:
            return Turn(token_ids=[], index=self.index, **lifecycle)
        return self.decoder.turn(**lifecycle)
