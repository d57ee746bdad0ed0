"""Structured output: the per-request logits mask that keeps a turn inside a JSON schema, a JSON
object, a regex, a list of choices or a Lark grammar (:class:`~precache.config.StructuredOutput`).

The grammar engine is llguidance (guidance-ai): DESIGN.md, "Structured output", says why (CPU
wheels with no GPU dependency, token masks computed in Rust in tens of microseconds from an Earley
parser over a lexer, the widest JSON-schema coverage of the three candidates, and vLLM, SGLang and
llama.cpp ship it). Each request gets its own matcher; the mask is applied to that request's row of
logits in :meth:`~precache.engine.decoding.Decoder.step`, so constrained and unconstrained
requests share every forward.
"""

from __future__ import annotations

import functools
import importlib
import json
import weakref
from typing import TYPE_CHECKING

import torch

from precache.config import StructuredOutput
from precache.errors import StructuredOutputError

if TYPE_CHECKING:
    import llguidance


@functools.cache
def _ll():
    """llguidance (with ``llguidance.hf``), imported when a constraint is first compiled: engines
    that never constrain a turn run without it (the GPU machine's image has no llguidance).

    Raises:
        ImportError: llguidance is not installed (a dependency of precache: ``pip install llguidance``).
    """
    try:
        module = importlib.import_module("llguidance")
        importlib.import_module("llguidance.hf")
    except ImportError as exc:
        raise ImportError(f"structured output needs llguidance ({exc}): pip install llguidance") from exc
    return module


def _ll_torch():
    """``llguidance.torch``, imported on first use: it wraps a kernel in ``torch.compile``, whose
    import (torch._dynamo and inductor) costs every command about 1.3 s at start-up."""
    return importlib.import_module("llguidance.torch")


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: JSON is written without free whitespace (``", "`` and ``": "`` between items; vLLM's
#: ``disable_any_whitespace``): with free whitespace a small model can emit newlines forever
#: inside an open array and never close it (SmolLM2 did, on a one-item array schema)
JSON_LAYOUT = {"whitespace_flexible": False}


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of an HF tokenizer (its token bytes and trie, ``eos_ids`` allowed once the
    constraint may end), built once per tokenizer, vocabulary size and EOS ids."""
    built = _TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab_size, eos_ids)
    if key not in built:
        try:
            built[key] = _ll().hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids) or None
            )
        except (ValueError, TypeError, AttributeError) as exc:
            raise StructuredOutputError(
                f"structured output needs a byte-level or SentencePiece fast tokenizer; this one cannot "
                f"be read by llguidance ({exc})"
            ) from exc
    return built[key]


@functools.lru_cache(maxsize=256)
def grammar_of(spec: StructuredOutput) -> str:
    """llguidance's grammar text for ``spec``.

    Raises:
        StructuredOutputError: the schema, pattern or grammar is malformed (the message says why).
    """
    try:
        if spec.kind == "json_schema":
            return _ll().LLMatcher.grammar_from_json_schema(json.loads(spec.spec), defaults=JSON_LAYOUT)
        if spec.kind == "json_object":
            return _ll().LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if spec.kind == "regex":
            return _ll().LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.spec))
            return _ll().LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return _ll().LLMatcher.grammar_from_lark(spec.spec)
    except (ValueError, TypeError) as exc:
        raise StructuredOutputError(f"structured_output {spec.kind}: {exc}") from exc


class GrammarMatcher:
    """Where one turn stands in its constraint. ``mask(logits)`` returns the logits with every
    forbidden token at -inf; ``accept(token)`` advances past a sampled token; ``done`` once the
    constraint is complete and nothing more may follow.

    Raises:
        StructuredOutputError: the constraint does not compile (on construction).
    """

    def __init__(self, tokenizer, vocab_size: int, spec: StructuredOutput, eos_ids: tuple[int, ...] = ()):
        if tokenizer is None:
            raise StructuredOutputError("structured_output needs a model with a tokenizer")
        grammar = grammar_of(spec)
        ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size, tuple(sorted(eos_ids)))
        self.matcher = _ll().LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise StructuredOutputError(f"structured_output {spec.kind}: {self.matcher.get_error()}")
        self.bitmask = _ll_torch().allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[vocab]`` (fp32) with the tokens the constraint forbids now at -inf (a copy)."""
        ll_torch = _ll_torch()
        ll_torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        out = logits.detach().to("cpu", torch.float32, copy=True).unsqueeze(0)
        ll_torch.apply_token_bitmask_inplace(out, self.bitmask)
        return out[0].to(logits.device)

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (sampled from a masked distribution, so always allowed).

        Raises:
            StructuredOutputError: the matcher refused it (a bug: the mask allowed it).
        """
        if not self.matcher.consume_token(token_id):
            raise StructuredOutputError(
                f"the constraint refused token {token_id}: {self.matcher.get_error()}"
            )

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()


@functools.lru_cache(maxsize=256)
def _grammar_error(spec: StructuredOutput) -> str:
    return _ll().LLMatcher.validate_grammar(grammar_of(spec))


def validate_structured_output(spec: StructuredOutput) -> None:
    """Refuse a constraint that does not compile, without a tokenizer (llguidance's own grammar
    check; a JSON schema's ``$ref`` that points nowhere is caught here too). Cheap enough for every
    tool schema of every request (results are cached per spec).

    Raises:
        StructuredOutputError: with the reason.
    """
    error = _grammar_error(spec)
    if error:
        raise StructuredOutputError(f"structured_output {spec.kind}: {error.strip()}")


def check_structured_output(engine, spec: StructuredOutput) -> None:
    """Refuse a constraint that does not compile for ``engine``'s tokenizer, before anything runs.

    Raises:
        StructuredOutputError: with the reason.
    """
    GrammarMatcher(engine.tokenizer, engine.model.config.vocab_size, spec, tuple(engine.eos_token_ids))
