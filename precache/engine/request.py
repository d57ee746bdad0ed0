"""What the engine scheduler works on: a request (one turn asked of a session), its state, the
tokens it streams out, and the one record of a finished turn (:class:`Turn`).

Plain Python: the scheduler (:mod:`precache.engine.scheduler`) moves a request from WAITING to
RUNNING when its turn opens on the caches, and to FINISHED (or CANCELLED, FAILED) once the turn
and its post-turn pass are over.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from precache.config import SamplingParams
from precache.errors import RequestCancelledError

if TYPE_CHECKING:
    import torch

    from precache.engine.session import Session
    from precache.engine.turn import SteppedTurn

_ids = itertools.count()


@dataclass(kw_only=True)
class Turn:
    """One agent's turn on a trajectory: the one record the engine, the agent loop, the benchmarks
    and the server share (built with keywords).

    ``agent``: the adapter (None: base model); ``token_ids``: the generated ids (all of them stay in
    the trajectory); ``text``: their text by the OpenAI rule of :class:`~precache.config.SamplingParams`
    (no stop string, no stop token's text, no partial character); ``trimmed``: the text that rule cut
    off the end (the stop string and what its token added past it, or the stop token's text), so
    ``text + trimmed`` is the text of every generated token. ``stop_reason``: ``eos``, ``stop`` (a
    stop string or a ``stop_token_ids`` id), ``length``, ``cancelled`` or ``error``;
    ``matched_stop``: the stop string or stop token id that ended the turn (vLLM's
    ``stop_reason``; None otherwise). ``logprobs``: one :class:`TokenLogprob` per generated token
    when the turn asked for them. Times in seconds: ``ttft_s``
    from the turn's opening to its first token, ``decode_s`` from there to the last token,
    ``neutral_s`` the post-turn pass (ReBaseShared LP's neutral prefill of ``neutral_tokens``
    tokens, outside the next turn's TTFT). ``prefill_tokens`` counts every row of the prefill
    forwards (ReBaseShared DB's neutral row included; a selective-recompute row counts its
    recomputed token-layers over the layer count, rounded up: ``RowPlan.prefill_cost``). ``appended``: the ids appended to the
    trajectory since the session's previous turn; ``prompt_tokens``: trajectory length when the
    turn opened; ``cached_tokens``: the first position the turn prefilled (prompt tokens read from
    the cache). ``kv_bytes``: the session's cache bytes once the turn is over. ``first_logits``
    ``[vocab]``: the fp32 logits the first token was sampled from; ``logits`` ``[n, vocab]``: every
    step's logits (teacher-forced turns only).
    """

    agent: str | None
    token_ids: list[int]
    text: str = ""
    stop_reason: str = ""
    matched_stop: str | int | None = None
    trimmed: str = ""
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)
    ttft_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    neutral_tokens: int = 0
    neutral_s: float = 0.0
    appended: tuple[int, ...] = field(default=(), repr=False)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kv_bytes: int = 0
    session_id: str = ""
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def new_tokens(self) -> int:
        """Tokens the turn generated."""
        return len(self.token_ids)

    @property
    def latency_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.token_ids) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def summary(self) -> dict:
        """JSON-ready scalars (no token ids, no logits)."""
        keys = ("agent", "text", "stop_reason", "ttft_s", "decode_s", "prefill_tokens")
        keys += ("neutral_tokens", "neutral_s", "prompt_tokens", "cached_tokens", "kv_bytes")
        return {"new_tokens": self.new_tokens, **{k: getattr(self, k) for k in keys}}


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's natural-log probability under the model's raw logits, and the ``top``
    most likely ids with theirs (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StreamChunk:
    """A token as it is sampled, with the text that is now safe to send (whole characters only,
    no part of a possible stop string: often "", and several tokens' text at once later; the
    chunks' texts concatenate to :attr:`Turn.text`), and its log-probabilities when asked for."""

    token_id: int
    text: str
    logprob: TokenLogprob | None = None


class RequestState(enum.Enum):
    """Where a request is: queued, in the batch, or over (with a result, cancelled, or failed)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(eq=False)
class Request:
    """One turn of ``agent`` (None: base model) asked of ``session``, whose trajectory ends with the
    prompt; ``forced`` replaces sampling by these tokens (teacher forcing).

    The scheduler fills ``turn`` (the open turn: the sequence being prefilled and decoded) when the
    request starts, appends each sampled token to ``chunks`` (any thread may pop them), and sets
    ``result`` (FINISHED) or ``error`` (FAILED) at the end. ``arrival``: ``perf_counter`` seconds.
    """

    session: Session
    agent: str | None
    params: SamplingParams
    forced: list[int] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.perf_counter)
    state: RequestState = RequestState.WAITING
    turn: SteppedTurn | None = field(default=None, repr=False)
    chunks: deque[StreamChunk] = field(default_factory=deque, repr=False)
    result: Turn | None = field(default=None, repr=False)
    error: BaseException | None = None
    cancel_requested: bool = False

    @property
    def finished(self) -> bool:
        """Over: the turn and its post-turn pass ran, or the request was cancelled or failed."""
        return self.state in (RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED)

    @property
    def closed(self) -> bool:
        """Every token is out (the post-turn pass may still be running)."""
        return self.finished or (self.turn is not None and self.turn.closed)

    def outcome(self) -> Turn:
        """The finished turn.

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
