"""One agent's turn on a session, advanced one forward at a time: the turn protocol, in one place.

The engine scheduler (:mod:`precache.engine.scheduler`) holds one :class:`SteppedTurn` per running
request and puts the rows of every running turn in one forward (ARCHITECTURE.md, "The path of a
request"): ``prefill_start`` -> ``begin_turn`` -> prefill plans (chunked) -> sample -> one-token
decode plans -> ``end_turn``, whose post-turn plans (ReBaseShared LP's neutral pass) run last.
"""

from __future__ import annotations

import enum
import time

import torch

from precache.cache.plan import RowPlan
from precache.config import SamplingParams
from precache.engine.detokenize import IncrementalDetokenizer, StopStrings
from precache.engine.request import TokenLogprob, Turn
from precache.engine.sampler import sample, shape_logits, token_logprobs


class TurnPhase(enum.Enum):
    """``PREFILL`` -> ``DECODE`` -> (``POST``: the post-turn pass) -> ``DONE``."""

    PREFILL = "prefill"
    DECODE = "decode"
    POST = "post"
    DONE = "done"


class SteppedTurn:
    """A turn of ``agent`` (None: base model) on ``session``, whose trajectory ends with the prompt.
    Opening it starts the turn on the caches (between turns only).

    Each step: :meth:`plans` gives this turn's rows for the next forward, the caller runs them
    (alone or with other turns' rows), then :meth:`advance` takes the first row's logits
    ``[vocab]``. ``cached_tokens`` is the first prefill position (prompt tokens read from the
    cache); ``forced`` replaces the sampler by these tokens (teacher forcing, logits kept in
    ``logits``). Times (seconds, ``time.perf_counter``): ``t_open``, ``t_first`` (first token),
    ``t_end`` (turn closed), ``t_done`` (post-turn pass run).

    Raises:
        EmptyRequestError, ContextLengthError: the trajectory has no prompt or no room left
            (checked before any cache is touched).
    """

    def __init__(self, session, agent: str | None, params: SamplingParams, forced: list[int] | None = None):
        session.check_room(len(forced) if forced else 0)
        budget = len(forced) if forced else params.max_new_tokens
        session.method.check_fits(session.state, len(session.token_ids) + budget)
        self.session, self.agent, self.params = session, agent, params
        self.method, self.forced = session.method, forced
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.budget = min(params.max_new_tokens, session.engine.max_context - len(session.token_ids))
        self.out: list[int] = []
        engine = session.engine
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
        self.text: list[str] = []  # the pieces sent so far (their concatenation is the turn's text)
        self.matched_stop: str | int | None = None
        self.token_logprobs: list[TokenLogprob] = []
        self.logits: list[torch.Tensor] = []
        self.first_logits: torch.Tensor | None = None
        self.finish_reason: str | None = None
        self.post: list[RowPlan] = []
        self.prefill_tokens = self._chunk_tokens = 0
        self._end = 0
        self.t_open = time.perf_counter()
        self.t_first = self.t_end = self.t_done = 0.0
        n, state = len(session.token_ids), session.state
        self.prompt_tokens = n
        self.appended = tuple(session.token_ids[session.last_turn_end :])
        # blocks other trajectories published for the same token prefix (never the last token)
        reused = self.method.reuse_prefix(state, agent, session.token_ids)
        session.authors.extend([None] * (reused - len(session.authors)))  # their authors are not ours to know
        # all cached: re-read the last prompt token for its logits, writing no cache entry (the
        # entry belongs to whoever processed the token first: DESIGN.md, "Determinism")
        self.reread = self.method.prefill_start(state, agent) >= n
        self.method.begin_turn(state, agent)
        self.pos = self.cached_tokens = n - 1 if self.reread else self.method.prefill_start(state, agent)
        self.phase = TurnPhase.PREFILL

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.session.token_ids) - self.pos if self.phase is TurnPhase.PREFILL else 0

    @property
    def closed(self) -> bool:
        """Every token is out (the post-turn pass may still be due)."""
        return self.phase in (TurnPhase.POST, TurnPhase.DONE)

    def plans(self, max_prefill: int | None = None) -> list[RowPlan]:
        """Rows for the next forward: a prefill chunk of at most ``max_prefill`` tokens (None: all;
        at least one), the last sampled token, or the post-turn plans. The first row carries the logits."""
        s = self.session
        if self.phase is TurnPhase.POST:
            return self.post
        if self.phase is TurnPhase.DECODE:
            pos = len(s.token_ids) - 1
            self._end = pos + 1
            return self.method.plans(s.state, self.agent, [s.token_ids[pos]], pos)
        left = len(s.token_ids) - self.pos
        self._end = self.pos + (left if max_prefill is None else min(left, max(1, max_prefill)))
        plans = self.method.plans(s.state, self.agent, s.token_ids[self.pos : self._end], self.pos)
        if self.reread:  # the agent's own row only, reading the cached entry of the token itself
            plans = [RowPlan(p.token_ids, p.pos0, p.adapter, [], p.views) for p in plans[:1]]
        # counted once the forward ran; a recompute row counts its token-layers (RowPlan.prefill_cost)
        self._chunk_tokens = sum(p.prefill_cost for p in plans)
        if self._end < len(s.token_ids):  # an inner chunk: nothing to sample yet
            for plan in plans:
                plan.want_logits = False
        return plans

    def advance(self, logits: torch.Tensor | None) -> tuple[int, str, TokenLogprob | None] | None:
        """Take the forward of :meth:`plans`; return ``(token id, text now safe to send, its
        log-probabilities or None)`` when a token was sampled, None otherwise (an inner prefill
        chunk or the post-turn pass)."""
        s = self.session
        s.note_cache_bytes()
        if self.phase is TurnPhase.POST:
            self.phase, self.t_done = TurnPhase.DONE, time.perf_counter()
            self.method.publish_prefix(s.state, s.token_ids)  # the pass completed more blocks
            return None
        s.authors.extend([self.agent] * (self._end - len(s.authors)))
        if self.phase is TurnPhase.PREFILL:
            self.prefill_tokens += self._chunk_tokens
            self.pos = self._end
            if self.pos < len(s.token_ids):
                return None
            self.phase, self.first_logits = TurnPhase.DECODE, logits
        if self.forced is not None:
            self.logits.append(logits)
            token = self.forced[len(self.out)]
        else:
            shaped = logits
            if self.params.shapes_logits:
                prompt = s.token_ids[: self.prompt_tokens]
                shaped = shape_logits(logits, self.params, prompt, self.out, self.stop_ids)
            token = sample(shaped, self.params, self.generator)
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
        self.text.append(text)
        if reason or len(self.out) >= self.budget:
            self.finish(reason or "length")
            text += self.text[-1]  # what the detokenizer and the stop rule held back
        return token, text, logprob

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
        self.finish_reason, self.t_end = reason, time.perf_counter()
        self.text.append(self._flush())
        self.post = self.method.end_turn(self.session.state, self.agent, self.session.token_ids)
        self.session.last_turn_end = len(self.session.token_ids)
        self.phase = TurnPhase.POST if self.post else TurnPhase.DONE
        if not self.post:
            self.t_done = self.t_end

    def abort(self, reason: str) -> None:
        """Close the turn and skip its post-turn pass (after a failed forward)."""
        self.finish(reason)
        self.post, self.phase = [], TurnPhase.DONE
        self.t_done = self.t_done or time.perf_counter()

    def record(self) -> Turn:
        """The turn so far as a :class:`~precache.engine.request.Turn` (its final record once DONE)."""
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
            first_logits=self.first_logits,
            logits=torch.stack(self.logits) if self.forced is not None and self.logits else None,
        )
