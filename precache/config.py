"""Frozen configuration dataclasses shared by the engine, the CLI and the server."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TypedDict

from precache.errors import EmptyRequestError

#: temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``)
GREEDY_TEMPERATURE = 1e-5


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint every generated token must keep (vLLM's structured outputs): ``kind`` is
    ``json_schema`` (``spec``: the schema as JSON text), ``json_object`` (any JSON object; ``spec``
    empty), ``regex`` (``spec``: the pattern, matched in full), ``choice`` (``spec``: a JSON list of
    the allowed texts) or ``grammar`` (``spec``: a Lark grammar, llguidance's dialect). Build one
    with the class methods; :mod:`precache.engine.structured` enforces it."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured_output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}"
            )

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutput:
        """Output that parses as JSON and validates against ``schema`` (a dict or JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Output that parses as a JSON object (OpenAI's ``response_format: json_object``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        """Output equal to one of ``choices``."""
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("structured_output choice needs a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, lark: str) -> StructuredOutput:
        return cls("grammar", lark)


@dataclass(frozen=True)
class SamplingParams:
    """How a turn samples and what text it returns (the fields and defaults of vLLM's
    ``SamplingParams``). ``temperature=0`` (any below 1e-5, as vLLM) is greedy and deterministic; ``seed`` makes sampling with
    ``temperature > 0`` reproducible.

    Logits, in this order (vLLM's order; each step is off at its default):

    1. ``logit_bias`` ``{token id: bias}`` is added (OpenAI: bias in [-100, 100]);
    2. while fewer than ``min_tokens`` tokens are out, the stop tokens (the EOS ids unless
       ``ignore_eos``, and ``stop_token_ids``) are masked to -inf;
    3. ``repetition_penalty`` (HF transformers' ``RepetitionPenaltyLogitsProcessor``, Keskar et al.
       2019): for every token id of the prompt and the output, a positive logit is divided by the
       penalty and a negative one multiplied by it;
    4. ``frequency_penalty`` and ``presence_penalty`` (the OpenAI formula, over the output tokens):
       ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``;
    5. ``structured_output`` (:class:`StructuredOutput`): every token the constraint forbids is
       masked to -inf (a per-request logits mask from llguidance, :mod:`precache.engine.structured`);
       the turn ends with ``stop`` once the constraint is complete (nothing more may follow);
    6. greedy: argmax; else ``temperature``, ``min_p`` (drop tokens with a probability below
       ``min_p`` times the top one), ``top_k`` (0 or -1: off), ``top_p`` (nucleus), then a draw.

    ``n``: choices sampled from one prompt (vLLM's parallel sampling): the prompt is prefilled
    once, then the choices fork its caches (copy-on-write) and decode in the same steps; choice
    ``i > 0`` samples with ``seed + i`` when ``seed`` is set.

    ``logprobs``: return the log-probability of each sampled token and of the ``logprobs`` most
    likely ones (:attr:`~precache.engine.request.Turn.logprobs`), computed from the model's raw
    logits (before step 1; vLLM's default ``raw_logprobs`` mode).

    Text (the OpenAI rule, one rule for the library and the server): the turn ends right after the
    token that completes a ``stop`` string, or after a stop token (an EOS id unless ``ignore_eos``,
    or one of ``stop_token_ids``); neither the stop string nor the stop token's text is part of the
    returned text (``include_stop_str_in_output`` keeps them, as in vLLM); the text a stopping
    token adds past the stop string is dropped too. Stop strings and stop tokens are not checked
    before ``min_tokens`` tokens are out. ``skip_special_tokens`` drops special tokens' text
    (vLLM's default); ``spaces_between_special_tokens`` is the tokenizer's own option of the same
    name (slow tokenizers; fast ones ignore it).

    Raises:
        EmptyRequestError: ``max_new_tokens < 1``.
        ValueError: a field out of range (the message names it).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    structured_output: StructuredOutput | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise EmptyRequestError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        checks = [
            (0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2]", self.temperature),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", self.top_p),
            (self.top_k >= -1, "top_k must be -1, 0 (off) or positive", self.top_k),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", self.min_p),
            (self.min_tokens >= 0, "min_tokens must be >= 0", self.min_tokens),
            (isinstance(self.n, int) and self.n >= 1, "n must be an integer >= 1", self.n),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0", self.repetition_penalty),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty must be in [-2, 2]",
                self.frequency_penalty,
            ),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty must be in [-2, 2]",
                self.presence_penalty,
            ),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0", self.logprobs),
            (
                all(-100.0 <= b <= 100.0 for _, b in self.logit_bias),
                "logit_bias values must be in [-100, 100]",
                dict(self.logit_bias),
            ),
        ]
        checks.append((all(self.stop), "stop must not contain an empty string", list(self.stop)))
        for ok, message, value in checks:
            if not ok:
                raise ValueError(f"{message}, got {value}")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_new_tokens ({self.max_new_tokens})"
            )

    @property
    def greedy(self) -> bool:
        """Argmax sampling: ``temperature`` below :data:`GREEDY_TEMPERATURE` (vLLM's
        ``_SAMPLING_EPS``; dividing by a smaller one overflows the logits)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def shapes_logits(self) -> bool:
        """Some logits step (bias, min_tokens, penalties) is on."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
        )


class SamplingOptions(TypedDict, total=False):
    """:class:`SamplingParams` as keyword arguments (``Session.generate(agent, **options)``), named
    so that editors and type checkers see them; ``stop`` may also be one string, ``stop_token_ids``
    any iterable of ids and ``logit_bias`` a ``{token id: bias}`` dict. The same fields as
    :class:`SamplingParams` (a test holds them equal)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: str | list[str] | tuple[str, ...]
    seed: int | None
    ignore_eos: bool
    min_p: float
    min_tokens: int
    stop_token_ids: list[int] | tuple[int, ...]
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...]
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logprobs: int | None
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    n: int
    structured_output: StructuredOutput | None
