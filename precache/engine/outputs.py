"""What a request gives back: the one record of a finished turn (:class:`Turn`), each token as it
is sampled (:class:`StreamChunk`) and its log-probabilities (:class:`TokenLogprob`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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
    the cache). ``index``: the choice (parallel sampling, ``SamplingParams.n``; 0 otherwise).
    ``kv_bytes``: the session's cache bytes once the turn is over. ``first_logits``
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
    index: int = 0
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def new_tokens(self) -> int:
        """Tokens the turn generated."""
        return len(self.token_ids)

    @property
    def latency_s(self) -> float:
        return self.ttft_s + self.decode_s

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
    """A token of choice ``index`` as it is sampled, with the text that is now safe to send (whole characters only,
    no part of a possible stop string: often "", and several tokens' text at once later; the
    chunks' texts concatenate to :attr:`Turn.text`), and its log-probabilities when asked for."""

    token_id: int
    text: str
    logprob: TokenLogprob | None = None
    index: int = 0
