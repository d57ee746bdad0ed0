"""One agent's turn on a session, advanced one forward at a time: the step-wise form of
``Session._turn`` that the scheduler interleaves with other sessions' turns in one batch.

Protocol (ARCHITECTURE.md, "The path of a request"): ``prefill_start`` -> ``begin_turn`` ->
prefill plans (here in chunks) -> sample -> one-token decode plans -> ``end_turn``, whose post-turn
plans (ReBaseShared LP's neutral pass) run in a later batch before the session is free again.
"""

from __future__ import annotations

import torch

from precache.cache.plan import RowPlan
from precache.config import SamplingParams
from precache.engine.sampler import sample
from precache.engine.session import Session

PREFILL, DECODE, POST, DONE = "prefill", "decode", "post", "done"


class SteppedTurn:
    """A turn of ``agent`` (None: base model) on ``session``, whose trajectory already ends with
    the prompt. Opening it starts the turn on the caches (call between turns only).

    Each step: :meth:`plans` gives the rows of this turn for the next forward, the scheduler runs
    them with other turns' rows, then :meth:`advance` takes the first row's logits ``[vocab]``.
    ``phase`` goes ``prefill`` -> ``decode`` -> (``post``) -> ``done``. ``cached_tokens``: prompt
    tokens read from the cache instead of prefilled (the turn's first prefill position).
    """

    def __init__(self, session: Session, agent: str | None, params: SamplingParams, codec, ignore_eos=False):
        self.session, self.agent, self.params, self.codec = session, agent, params, codec
        self.method, self.ignore_eos = session.method, ignore_eos
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.budget = min(params.max_new_tokens, session.engine.max_context - len(session.token_ids))
        self.out: list[int] = []
        self.finish_reason: str | None = None
        self.post: list[RowPlan] = []
        self._end = 0
        n, state = len(session.token_ids), session.state
        if self.method.prefill_start(state, agent) >= n:  # all cached: recompute the last token
            self.method.truncate(state, n - 1)
            del session.authors[n - 1 :]
        self.method.begin_turn(state, agent)
        self.pos = self.cached_tokens = self.method.prefill_start(state, agent)
        self.phase = PREFILL

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.session.token_ids) - self.pos if self.phase == PREFILL else 0

    def plans(self, max_prefill: int) -> list[RowPlan]:
        """Rows for the next forward: a prefill chunk of at most ``max_prefill`` tokens (at least
        one), the last sampled token, or the post-turn plans. The first row carries the logits."""
        s = self.session
        if self.phase == POST:
            return self.post
        if self.phase == DECODE:
            pos = len(s.token_ids) - 1
            self._end = pos + 1
            return self.method.plans(s.state, self.agent, [s.token_ids[pos]], pos)
        self._end = min(len(s.token_ids), self.pos + max(1, max_prefill))
        plans = self.method.plans(s.state, self.agent, s.token_ids[self.pos : self._end], self.pos)
        if self._end < len(s.token_ids):  # an inner chunk: nothing to sample yet
            for plan in plans:
                plan.want_logits = False
        return plans

    def advance(self, logits: torch.Tensor | None) -> tuple[int, str] | None:
        """Take the forward of :meth:`plans`; return ``(token id, text it adds)`` when a token was
        sampled, None otherwise (an inner prefill chunk or the post-turn pass)."""
        s = self.session
        if self.phase == POST:
            self.phase = DONE
            return None
        s.authors.extend([self.agent] * (self._end - len(s.authors)))
        if self.phase == PREFILL:
            self.pos = self._end
            if self.pos < len(s.token_ids):
                return None
            self.phase = DECODE
        token = sample(logits, self.params, self.generator)
        self.out.append(token)
        s.token_ids.append(token)
        reason = self._stop_reason()
        if reason or len(self.out) >= self.budget:
            self.finish(reason or "length")
        return token, "" if reason == "eos" else self.codec.decode_piece(self.out)

    def finish(self, reason: str) -> None:
        """Close the turn now (``reason``: eos, stop, length or cancelled); the tokens so far stay
        in the trajectory. No-op when already closed."""
        if self.phase not in (PREFILL, DECODE):
            return
        self.finish_reason = reason
        self.post = self.method.end_turn(self.session.state, self.agent, self.session.token_ids)
        self.phase = POST if self.post else DONE

    def _stop_reason(self) -> str | None:
        if not self.ignore_eos and self.out[-1] in self.session.engine.eos_token_ids:
            return "eos"
        if self.params.stop:
            tail = self.codec.decode(self.out[-16:])
            if any(stop in tail for stop in self.params.stop):
                return "stop"
        return None
