"""Decoding: what one turn does with its row of logits each step, and what it gives back.

A step's logits for a request, ``[vocab]`` (fp32), become its next token and a
:class:`~precache.engine.outputs.StreamChunk` here: the logits are shaped (logit bias, min_tokens,
penalties: :func:`~precache.engine.sampler.shape_logits`), masked by the turn's structured-output
constraint (:class:`~precache.engine.structured.GrammarMatcher`), sampled
(:func:`~precache.engine.sampler.sample`; a teacher-forced turn takes its next forced token
instead), the token's log-probabilities read from the raw logits when asked for, and its text
passed through the incremental detokenizer and the stop-string rule
(:mod:`precache.engine.detokenize`), so a chunk never carries a partial character nor the start of
a stop string. At the end :meth:`Decoder.close` releases what those two held back and
:meth:`Decoder.turn` builds the :class:`~precache.engine.outputs.Turn`.

A :class:`Decoder` knows nothing of caches, rows or sessions: the request
(:mod:`precache.engine.request`) appends the token to its trajectory and decides when the turn ends
(a stop reason from here, or its token budget). :func:`eos_token_ids` reads the EOS ids a model
declares, which end every turn unless ``ignore_eos``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from precache.config import SamplingParams
from precache.engine.detokenize import IncrementalDetokenizer, StopStrings
from precache.engine.outputs import StreamChunk, TokenLogprob, Turn
from precache.engine.sampler import sample, shape_logits, token_logprobs
from precache.engine.structured import GrammarMatcher


def eos_token_ids(model) -> frozenset[int]:
    """Token ids that end a turn of ``model``: ``generation_config.json``'s ``eos_token_id`` (an int
    or a list, e.g. Llama-3's ``<|end_of_text|>`` and ``<|eot_id|>``), which HF ``generate`` stops
    on, plus config.json's and the tokenizer's EOS (what chat templates end a message with). Empty
    when none of them names one."""
    ids: set[int] = set()
    for src in (
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(model.hf_config, "eos_token_id", None),
        getattr(model.tokenizer, "eos_token_id", None),
    ):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(i) for i in src)
    return frozenset(ids)


@dataclass(slots=True, eq=False)
class Decoder:
    """One turn's decoding state, from its first sampled token to its :class:`Turn`.

    ``stop_ids``: the token ids that end the turn (``params.stop_token_ids``, plus the engine's EOS
    ids unless ``ignore_eos``); ``prompt``: the prompt's token ids, kept only when the parameters
    shape the logits (the repetition penalty reads them); ``forced``: a teacher-forced turn's token
    ids (taken in order instead of sampling; every step's logits are kept in ``logits``);
    ``index``: the choice (parallel sampling). ``out``: the token ids so far; ``text``: the pieces
    sent so far (their concatenation is the turn's text); ``first_logits`` ``[vocab]``: the logits
    the first token was sampled from, when the request keeps them; ``finish_reason``: eos, stop,
    length, cancelled or error once :meth:`close` ran.
    """

    params: SamplingParams
    stop_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    grammar: GrammarMatcher | None = None
    generator: torch.Generator | None = None
    forced: list[int] | None = None
    prompt: tuple[int, ...] = field(default=(), repr=False)
    index: int = 0
    out: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    matched_stop: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    finish_reason: str | None = None

    @classmethod
    def start(
        cls,
        engine,
        params: SamplingParams,
        prompt: Sequence[int] = (),
        forced: list[int] | None = None,
        index: int = 0,
    ) -> Decoder:
        """The decoder of a turn of ``engine`` (its tokenizer, vocabulary and EOS ids) with
        ``params``, opening on ``prompt`` (token ids).

        Raises:
            StructuredOutputError: the structured-output constraint does not compile.
        """
        ignored = frozenset() if params.ignore_eos else frozenset(engine.eos_token_ids)
        grammar = None
        if params.structured_output is not None and forced is None:
            vocab = engine.model.config.vocab_size
            eos = tuple(engine.eos_token_ids)
            grammar = GrammarMatcher(engine.tokenizer, vocab, params.structured_output, eos)
        return cls(
            params=params,
            stop_ids=frozenset(params.stop_token_ids) | ignored,
            detokenizer=IncrementalDetokenizer(
                lambda ids: engine.decode(
                    ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                )
            ),
            stops=StopStrings(params.stop, params.include_stop_str_in_output),
            grammar=grammar,
            generator=torch.Generator().manual_seed(params.seed) if params.seed is not None else None,
            forced=forced,
            prompt=tuple(prompt) if params.shapes_logits else (),
            index=index,
        )

    def step(self, logits: torch.Tensor) -> tuple[StreamChunk, str | None]:
        """Take the next token from ``logits`` ``[vocab]`` (fp32, raw): sampled, or the next forced
        one. Returns its chunk (the text it makes safe to send, its log-probabilities when asked
        for) and the stop reason it causes (``eos`` or ``stop``; None: the turn may go on).

        Raises:
            StructuredOutputError: the constraint refused a token its own mask allowed (a bug).
        """
        token = self._next_token(logits)
        logprob = None
        if self.params.logprobs is not None:
            lp, top = token_logprobs(logits, token, self.params.logprobs)
            logprob = TokenLogprob(token, lp, tuple(top))
            self.logprobs.append(logprob)
        self.out.append(token)
        text, reason = self._text(token)
        if reason is None and self.grammar is not None and self.grammar.done:
            reason = "stop"  # the constraint is complete: nothing more may follow
        self.text.append(text)
        return StreamChunk(token, text, logprob, self.index), reason

    def _next_token(self, logits: torch.Tensor) -> int:
        if self.forced is not None:
            self.logits.append(logits)
            return self.forced[len(self.out)]
        shaped = logits
        if self.params.shapes_logits:
            shaped = shape_logits(logits, self.params, self.prompt, self.out, self.stop_ids)
        if self.grammar is not None:
            shaped = self.grammar.mask(shaped)
        token = sample(shaped, self.params, self.generator)
        if self.grammar is not None and token not in self.stop_ids:
            self.grammar.accept(token)
        return token

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

    def close(self, reason: str) -> str:
        """End the turn's text with ``reason`` (eos, stop, length, cancelled or error): returns what
        the detokenizer and the stop-string rule still held back (now part of the text)."""
        self.finish_reason = reason
        if self.stops.matched is not None:
            self.stops.cut += self.detokenizer.flush()
            held = ""
        elif reason in ("eos", "stop"):  # a stop token: its text is already placed
            held = ""
        else:
            held = self.stops.feed(self.detokenizer.flush(), check=False)[0] + self.stops.flush()
        self.text.append(held)
        return held

    def turn(self, **lifecycle) -> Turn:
        """The turn so far as a :class:`Turn`: its tokens, text, stop reason, log-probabilities and
        logits from here, every other field (``agent``, times, token counts) from ``lifecycle``."""
        return Turn(
            token_ids=list(self.out),
            text="".join(self.text),
            stop_reason=self.finish_reason or "",
            matched_stop=self.matched_stop,
            trimmed=self.stops.cut,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            index=self.index,
            first_logits=self.first_logits,
            logits=torch.stack(self.logits) if self.forced is not None and self.logits else None,
            **lifecycle,
        )
