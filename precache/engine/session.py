"""A session: one shared trajectory, its caches, and the agents' turns on it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from precache.cache.plan import run_plans
from precache.config import SamplingParams
from precache.engine.turn import DONE, SteppedTurn
from precache.errors import ContextLengthError, EmptyRequestError, UnknownAdapterError


@dataclass
class Turn:
    """One agent's turn. Times in seconds; ``prefill_tokens`` counts every row of the prefill
    forward (ReBaseShared DB's neutral row included); ``neutral_tokens``/``neutral_s`` are LP's
    post-turn neutral pass, which runs outside the next turn's TTFT. ``start`` is the first position
    the turn prefilled; ``first_logits`` ``[vocab]`` the fp32 logits the first token was sampled from;
    ``logits`` ``[n, vocab]`` every step's logits (teacher-forced turns only)."""

    agent: str | None
    token_ids: list[int]
    text: str
    ttft_s: float
    decode_s: float
    prefill_tokens: int
    stop_reason: str
    neutral_tokens: int = 0
    neutral_s: float = 0.0
    start: int = 0
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def latency_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.token_ids) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass
class StreamChunk:
    """A token as it is generated, with the text it adds."""

    token_id: int
    text: str


@dataclass
class Session:
    """One trajectory shared by all agents of an :class:`~precache.engine.engine.Engine`.

    ``token_ids`` is the whole trajectory; ``authors[t]`` the agent whose forward processed token
    t first (DESIGN.md, Notation). The caches live in ``state`` (see :mod:`precache.methods`).
    """

    engine: object
    token_ids: list[int] = field(default_factory=list)
    authors: list[str | None] = field(default_factory=list)
    peak_bytes: int = 0
    last_turn: Turn | None = None

    def __post_init__(self):
        self.method = self.engine.method
        self.state = self.method.new_state()

    def __len__(self) -> int:
        return len(self.token_ids)

    # -- the trajectory ------------------------------------------------------------------------
    def append(self, content: str | list[int]) -> int:
        """Append text (tokenised without special tokens) or token ids; return how many tokens.

        Raises:
            ContextLengthError: the trajectory would pass the model's context length (nothing appended).
        """
        ids = self.engine.encode(content) if isinstance(content, str) else [int(t) for t in content]
        if len(self.token_ids) + len(ids) > self.engine.max_context:
            raise ContextLengthError(
                f"appending {len(ids)} tokens to a {len(self.token_ids)}-token trajectory passes the "
                f"context length of {self.engine.max_context}"
            )
        self.token_ids.extend(ids)
        return len(ids)

    def sync(self, token_ids: list[int]) -> int:
        """Make the trajectory equal ``token_ids``, cutting every cache back to the common prefix
        (DESIGN.md fact 6). Returns the common prefix length."""
        common = 0
        for a, b in zip(self.token_ids, token_ids, strict=False):
            if a != b:
                break
            common += 1
        if common < len(self.token_ids):
            self.method.truncate(self.state, common)
            del self.authors[common:]
            del self.token_ids[common:]
        self.append(list(token_ids[common:]))
        return common

    def segments(self) -> list[tuple[str | None, int, int]]:
        """``(author, start, end)`` runs of processed tokens."""
        out: list[tuple[str | None, int, int]] = []
        for t, a in enumerate(self.authors):
            if out and out[-1][0] == a:
                out[-1] = (a, out[-1][1], t + 1)
            else:
                out.append((a, t, t + 1))
        return out

    def cache_bytes(self) -> dict:
        """Bytes per cache: ``{"base", "lr": {agent: n}, "full": {agent: n}, "turn", "total", "peak"}``."""
        out = self.method.cache_bytes(self.state)
        out["peak"] = self.peak_bytes
        return out

    def check(self) -> None:
        """Cache integrity check (raises :class:`~precache.errors.CacheIntegrityError`)."""
        self.method.check(self.state)

    # -- turns ---------------------------------------------------------------------------------
    def generate(self, agent: str | None = None, **kwargs) -> Turn:
        """Run one turn for ``agent`` (None: base model) and return it. Keyword arguments are
        :class:`~precache.config.SamplingParams` fields (``max_new_tokens``, ``temperature``, ``stop``, ...).

        Raises:
            UnknownAdapterError, EmptyRequestError, ContextLengthError, ValueError: bad request;
            the session is left unchanged.
        """
        for _ in self.stream(agent, **kwargs):
            pass
        return self.last_turn

    def stream(self, agent: str | None = None, **kwargs) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, yielding each token as it is sampled; the turn lands in ``last_turn``.

        Validation happens on the call, before the first token is requested.
        """
        params = self.validate(agent, kwargs)
        return self._turn(agent, params)

    def validate(self, agent: str | None, kwargs: dict) -> SamplingParams:
        """Check a turn request against this session; return its :class:`SamplingParams`.

        Raises:
            UnknownAdapterError, EmptyRequestError, ContextLengthError, ValueError: bad request.
        """
        if agent is not None and agent not in self.engine.adapters:
            loaded = ", ".join(self.engine.adapters) or "none"
            raise UnknownAdapterError(f"adapter '{agent}' is not loaded (loaded: {loaded})")
        if "stop" in kwargs:
            stop = kwargs["stop"]
            kwargs["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        params = SamplingParams(**kwargs)
        if not self.token_ids:
            raise EmptyRequestError("the trajectory is empty: append a prompt before generating")
        if len(self.token_ids) >= self.engine.max_context:
            raise ContextLengthError(
                f"the trajectory has {len(self.token_ids)} tokens, the context length is {self.engine.max_context}"
            )
        return params

    def note_cache_bytes(self) -> None:
        """Fold the current cache size into ``peak_bytes`` (called after every forward)."""
        self.peak_bytes = max(self.peak_bytes, self.method.cache_bytes(self.state)["total"])

    def teacher_force(self, agent: str | None, token_ids: list[int]) -> Turn:
        """Run ``agent``'s turn producing exactly ``token_ids`` (teacher forcing) and return it, with
        ``turn.logits`` ``[len(token_ids), vocab]``: the fp32 logits each forced token was predicted
        from. The caches end as after a turn that generated those tokens (the last one pending).

        Raises:
            UnknownAdapterError, EmptyRequestError, ContextLengthError: as :meth:`generate`.
        """
        if not token_ids:
            raise EmptyRequestError("teacher forcing needs at least one token")
        params = self.validate(agent, {"max_new_tokens": len(token_ids)})
        if len(self.token_ids) + len(token_ids) > self.engine.max_context:
            raise ContextLengthError(
                f"forcing {len(token_ids)} tokens passes the context length {self.engine.max_context}"
            )
        for _ in self._turn(agent, params, forced=list(token_ids)):
            pass
        return self.last_turn

    def _turn(
        self, agent: str | None, params: SamplingParams, forced: list[int] | None = None
    ) -> Iterator[StreamChunk]:
        turn = SteppedTurn(self, agent, params, forced=forced)
        try:
            while turn.phase != DONE:
                plans = turn.plans()
                step = turn.advance(run_plans(self.engine.model, plans)[0])
                if step is not None:
                    yield StreamChunk(*step)
        finally:
            if turn.phase != DONE:  # the consumer stopped early: close the turn, keep the caches sound
                turn.finish("cancelled")
                if turn.post:
                    run_plans(self.engine.model, turn.post)
        self.last_turn = Turn(
            agent,
            turn.out,
            self.engine.decode(turn.out),
            turn.t_first - turn.t_open,
            turn.t_end - turn.t_first,
            turn.prefill_tokens,
            turn.finish_reason,
            sum(len(p.token_ids) for p in turn.post),
            turn.t_done - turn.t_end,
            turn.cached_tokens,
            turn.first_logits,
            torch.stack(turn.logits) if forced is not None else None,
        )
