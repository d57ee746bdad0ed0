"""The request: one turn asked of a session, carried in one record from submission to its output
(what ``Sequence`` is in nano-vllm): its sampling parameters, the token ids it generated, its
state, the caches it works on (its session's block tables, or their host copies while they are
swapped out) and what it gives back (:class:`~precache.engine.outputs.StreamChunk` as tokens come,
:class:`~precache.engine.outputs.Turn` at the end).

The scheduler (:mod:`precache.engine.scheduler`) moves it WAITING -> RUNNING when its turn opens
on the caches (``prefill_start`` -> ``begin_turn``), runs its rows (chunked prefill, then one
token per step) and ends it FINISHED, CANCELLED or FAILED once the turn and its post-turn pass
(ReBaseShared LP's neutral prefill) ran. Under memory pressure it may be PREEMPTED (its caches
swapped out, :mod:`precache.engine.preemption`) and RUNNING again later, its tokens kept.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from precache.cache.rowplan import RowPlan
from precache.config import SamplingParams
from precache.engine.detokenize import IncrementalDetokenizer, StopStrings
from precache.engine.outputs import StreamChunk, TokenLogprob, Turn
from precache.engine.sampler import sample, shape_logits, token_logprobs
from precache.engine.structured import GrammarMatcher
from precache.errors import RequestCancelledError, UnknownAdapterError

if TYPE_CHECKING:
    from precache.cache.swap import SwappedBlocks
    from precache.engine.session import Session

_ids = itertools.count()


class RequestState(enum.Enum):
    """Where a request is: queued, in the batch, swapped out, or over (with a result, cancelled, or
    failed)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


class Phase(enum.Enum):
    """Where the open turn is: ``PREFILL`` -> ``DECODE`` -> (``POST``: the post-turn pass) -> ``DONE``."""

    PREFILL = "prefill"
    DECODE = "decode"
    POST = "post"
    DONE = "done"


@dataclass(eq=False)
class Request:
    """One turn of ``agent`` (None: base model) asked of ``session``, whose trajectory ends with the
    prompt; ``forced`` replaces sampling by these tokens (teacher forcing, logits kept).

    ``params.n > 1`` asks for parallel sampling: once the prompt is prefilled, choices 1..n-1 are
    requests of their own (``children``, ``index`` i, ``parent`` this one) on forks of the session
    that share its blocks, and they decode in the same steps. ``chunks``: the sampled tokens (any
    thread may pop them); ``result`` (FINISHED or CANCELLED) or ``error`` (FAILED) at the end;
    ``arrival``: ``perf_counter`` seconds (with ``id``, the request's age: older goes first, and a
    younger request never preempts an older one). Turn times (seconds, ``perf_counter``):
    ``t_open``, ``t_first`` (first token), ``t_end`` (turn closed), ``t_done`` (post-turn pass run).
    ``held``: whoever reads ``chunks`` asked the request to wait (a server stream whose client
    stopped reading): while held, a running request takes no rows and keeps its blocks (a younger
    one may still be preempted for room, as any); set and cleared from any thread, read per step.
    """

    session: Session
    agent: str | None
    params: SamplingParams
    forced: list[int] | None = None
    index: int = 0
    parent: Request | None = field(default=None, repr=False)
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.perf_counter)
    state: RequestState = RequestState.WAITING
    phase: Phase | None = None  # None until the turn opens
    chunks: deque[StreamChunk] = field(default_factory=deque, repr=False)
    children: list[Request] = field(default_factory=list, repr=False)
    result: Turn | None = field(default=None, repr=False)
    error: BaseException | None = None
    cancel_requested: bool = False
    held: bool = False
    preemptions: int = 0

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
            EmptyRequestError, ContextLengthError: no prompt, or no room left.
            CacheCapacityError: the turn (all ``n`` choices) could never fit the block pool.
        """
        s, params, forced = self.session, self.params, self.forced
        s.method.sync_state(s.state)  # adapters loaded or unloaded since the last turn
        if self.agent is not None and self.agent not in s.method.adapters:
            raise UnknownAdapterError(f"adapter '{self.agent}' was unloaded before the request started")
        s.check_room(len(forced) if forced else 0)
        budget = len(forced) if forced else params.max_new_tokens
        method = self.method = s.method
        n = len(s.token_ids)
        method.check_fits(s.state, n + budget, choices=params.n)
        self._start_sampling()
        self.budget = min(params.max_new_tokens, s.engine.max_context - n)
        self.prefill_tokens = self._chunk_tokens = self._end = 0
        self.t_open, self.prompt_tokens = time.perf_counter(), n
        self.appended = tuple(s.token_ids[s.last_turn_end :])
        reused = method.reuse_prefix(s.state, self.agent, s.token_ids)
        s.authors.extend([None] * (reused - len(s.authors)))  # their authors are not ours to know
        # all cached: re-read the last prompt token for its logits, writing no cache entry (the
        # entry belongs to whoever processed the token first: DESIGN.md, "Determinism")
        self.reread = method.prefill_start(s.state, self.agent) >= n
        method.begin_turn(s.state, self.agent)
        # rows that build this agent's missing caches (an adapter added at run time), first forward
        self.catch_up = method.catch_up(s.state, self.agent, s.token_ids, s.authors)
        self.pos = self.cached_tokens = n - 1 if self.reread else method.prefill_start(s.state, self.agent)
        self.phase, self.state = Phase.PREFILL, RequestState.RUNNING
        s.active = self

    def _start_sampling(self) -> None:
        params, engine = self.params, self.session.engine
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.out: list[int] = []
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(engine.eos_token_ids)
        )
        self.detokenizer = IncrementalDetokenizer(
            lambda ids: engine.decode(
                ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        )
        self.stops = StopStrings(params.stop, params.include_stop_str_in_output)
        self.grammar = (
            GrammarMatcher(
                engine.tokenizer,
                engine.model.config.vocab_size,
                params.structured_output,
                tuple(engine.eos_token_ids),
            )
            if params.structured_output is not None and self.forced is None
            else None
        )
        self.text: list[str] = []  # the pieces sent so far (their concatenation is the turn's text)
        self.matched_stop: str | int | None = None
        self.token_logprobs: list[TokenLogprob] = []
        self.logits: list[torch.Tensor] = []
        self.first_logits: torch.Tensor | None = None
        self.finish_reason: str | None = None
        self.post: list[RowPlan] = []
        self.catch_up: list[RowPlan] = []
        self.t_first = self.t_end = self.t_done = 0.0

    def fork(self, session: Session, index: int) -> Request:
        """Choice ``index`` of this request on ``session`` (a fork of this one's caches with the turn
        open, its prompt prefilled): it samples its first token from the same logits."""
        seed = self.params.seed
        params = SamplingParams(
            **{**vars(self.params), "n": 1, "seed": None if seed is None else seed + index}
        )
        child = Request(session, self.agent, params, index=index, parent=self, arrival=self.arrival)
        child.method, child.cancel_requested = self.method, self.cancel_requested
        child._start_sampling()
        for name in (
            "budget",
            "t_open",
            "prompt_tokens",
            "appended",
            "reread",
            "pos",
            "cached_tokens",
            "_end",
        ):
            setattr(child, name, getattr(self, name))
        child.prefill_tokens = child._chunk_tokens = 0  # the prompt was prefilled once, by choice 0
        child.phase, child.state, session.active = Phase.DECODE, RequestState.RUNNING, child
        return child

    def plans(self, max_prefill: int | None = None) -> list[RowPlan]:
        """Rows for the next forward: a prefill chunk of at most ``max_prefill`` tokens (None: all;
        at least one), the last sampled token, or the post-turn plans. The first row carries the logits."""
        s, method = self.session, self.method
        if self.phase is Phase.POST:
            return self.post
        if self.phase is Phase.DECODE:
            pos = len(s.token_ids) - 1
            self._end = pos + 1
            return method.plans(s.state, self.agent, [s.token_ids[pos]], pos)
        left = len(s.token_ids) - self.pos
        self._end = self.pos + (left if max_prefill is None else min(left, max(1, max_prefill)))
        plans = method.plans(s.state, self.agent, s.token_ids[self.pos : self._end], self.pos)
        if self.reread:  # the agent's own row only, reading the cached entry of the token itself
            plans = [RowPlan(p.token_ids, p.pos0, p.adapter, [], p.views) for p in plans[:1]]
        plans += self.catch_up  # they write at every layer before the turn's rows read
        # counted once the forward ran; a recompute row counts its token-layers (RowPlan.prefill_cost)
        self._chunk_tokens = sum(p.prefill_cost for p in plans)
        if self._end < len(s.token_ids):  # an inner chunk: nothing to sample yet
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
            self.method.publish_prefix(s.state, s.token_ids)  # the pass completed more blocks
            return False
        s.authors.extend([self.agent] * (self._end - len(s.authors)))
        if self.phase is Phase.PREFILL:
            self.catch_up = []
            self.prefill_tokens += self._chunk_tokens
            self.pos = self._end
            if self.pos < len(s.token_ids):
                return False
        return True

    def sample(self, logits: torch.Tensor) -> StreamChunk:
        """Pick the next token from ``logits`` ``[vocab]`` (or take the forced one), append it to the
        trajectory and return it with the text now safe to send; closes the turn at a stop."""
        s = self.session
        if self.phase is Phase.PREFILL:
            self.phase, self.first_logits = Phase.DECODE, logits
        if self.forced is not None:
            self.logits.append(logits)
            token = self.forced[len(self.out)]
        else:
            shaped = logits
            if self.params.shapes_logits:
                prompt = s.token_ids[: self.prompt_tokens]
                shaped = shape_logits(logits, self.params, prompt, self.out, self.stop_ids)
            if self.grammar is not None:
                shaped = self.grammar.mask(shaped)
            token = sample(shaped, self.params, self.generator)
            if self.grammar is not None and token not in self.stop_ids:
                self.grammar.accept(token)
        logprob = None
        if self.params.logprobs is not None:
            lp, top = token_logprobs(logits, token, self.params.logprobs)
            logprob = TokenLogprob(token, lp, tuple(top))
            self.token_logprobs.append(logprob)
        self.out.append(token)
        s.token_ids.append(token)
        if len(self.out) == 1:
            self.t_first = time.perf_counter()
        text, reason = self._text(token)
        if reason is None and self.grammar is not None and self.grammar.done:
            reason = "stop"  # the constraint is complete: nothing more may follow
        self.text.append(text)
        if reason or len(self.out) >= self.budget:
            self.finish(reason or "length")
            text += self.text[-1]  # what the detokenizer and the stop rule held back
        chunk = StreamChunk(token, text, logprob, self.index)
        self.chunks.append(chunk)
        return chunk

    def _text(self, token: int) -> tuple[str, str | None]:
        """The text ``token`` makes safe to send, and the stop reason it causes (OpenAI rule)."""
        checked = self.forced is None and len(self.out) >= self.params.min_tokens
        if checked and token in self.stop_ids:
            self.matched_stop = token if token in self.params.stop_token_ids else None
            reason = "stop" if token in self.params.stop_token_ids else "eos"
            held = self.stops.feed(self.detokenizer.flush(), check=False)[0] + self.stops.flush()
            piece = self.detokenizer.push(token) + self.detokenizer.flush()
            if self.params.include_stop_str_in_output:
                return held + piece, reason
            self.stops.cut = piece
            return held, reason
        text, stop = self.stops.feed(self.detokenizer.push(token), check=checked)
        if stop is not None:
            self.matched_stop = stop
            return text, "stop"
        return text, None

    def _flush(self) -> str:
        """What the detokenizer and the stop-string rule still hold when the turn ends."""
        if self.stops.matched is not None:
            self.stops.cut += self.detokenizer.flush()
            return ""
        if self.finish_reason in ("eos", "stop"):  # a stop token: its text is already placed
            return ""
        return self.stops.feed(self.detokenizer.flush(), check=False)[0] + self.stops.flush()

    def finish(self, reason: str) -> None:
        """Close the turn now (``reason``: eos, stop, length or cancelled); the tokens so far stay
        in the trajectory. No-op when already closed."""
        if self.closed:
            return
        s = self.session
        self.finish_reason, self.t_end = reason, time.perf_counter()
        self.text.append(self._flush())
        self.post = self.method.end_turn(s.state, self.agent, s.token_ids)
        s.last_turn_end = len(s.token_ids)
        self.phase = Phase.POST if self.post else Phase.DONE
        if not self.post:
            self.t_done = self.t_end

    def abort(self, reason: str) -> None:
        """Close the turn and skip its post-turn pass (after a failed forward)."""
        self.finish(reason)
        self.post, self.phase = [], Phase.DONE
        self.t_done = self.t_done or time.perf_counter()

    def complete(self) -> Turn:
        """End the request once its turn and post-turn pass are over (phase DONE): its final record
        lands in ``result`` and the session's ``last_turn``, and the session is free again."""
        s = self.session
        self.result = self.record()
        s.active, s.last_turn, s.last_used = None, self.result, time.perf_counter()
        self.state = RequestState.CANCELLED if self.finish_reason == "cancelled" else RequestState.FINISHED
        return self.result

    def record(self) -> Turn:
        """The turn so far as a :class:`~precache.engine.outputs.Turn` (its final record once DONE)."""
        s = self.session
        t_first = self.t_first or self.t_end
        return Turn(
            agent=self.agent,
            token_ids=list(self.out),
            text="".join(self.text),
            stop_reason=self.finish_reason or "",
            matched_stop=self.matched_stop,
            trimmed=self.stops.cut,
            logprobs=list(self.token_logprobs) if self.params.logprobs is not None else None,
            ttft_s=max(t_first - self.t_open, 0.0),
            decode_s=max(self.t_end - t_first, 0.0),
            prefill_tokens=self.prefill_tokens,
            neutral_tokens=sum(len(p.token_ids) for p in self.post),
            neutral_s=max(self.t_done - self.t_end, 0.0),
            appended=self.appended,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            kv_bytes=s.cache_bytes()["total"],
            session_id=s.id,
            index=self.index,
            first_logits=self.first_logits,
            logits=torch.stack(self.logits) if self.forced is not None and self.logits else None,
        )
