"""Incremental detokenization and the stop-string rule: the text of a turn, piece by piece.

A character may span several tokens (an emoji or a CJK character is several bytes, and byte-level
BPE tokens split them): decoding one token alone gives U+FFFD. :class:`IncrementalDetokenizer`
decodes a window of the last emitted tokens plus the new ones and emits only the new suffix once
it no longer ends in U+FFFD (the bytes are held back until the character is whole; the method of
HF's ``TextStreamer`` and vLLM's detokenizer). :class:`StopStrings` then finds stop strings in
that text and holds back any tail that could still grow into one, so a streamed chunk never
carries the beginning of a stop string that later completes.

Both are plain Python over a ``decode(ids) -> str`` function; the concatenation of the pieces is
the turn's text, so ``Session.generate``, ``Session.stream`` and the server return the same text.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of a growing token sequence without partial characters.

    :meth:`push` takes one token id and returns the text that is now whole (often "" while a
    multi-byte character is incomplete); :meth:`flush` returns what is held back at the end (a
    truly invalid byte sequence then comes out as U+FFFD, as in a one-shot decode).
    ``"".join(pushes) + flush()`` equals ``decode(ids)`` for tokenizers whose decode of a sequence
    is the concatenation of its parts' decodes (byte-level BPE, SentencePiece byte fallback).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window: the last emitted group of tokens
        self._read = 0  # tokens whose text is out

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        window = self.decode(self.ids[self._prefix :])
        done = self.decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        if len(window) <= len(done) and not final:
            return ""
        if window.endswith(REPLACEMENT) and not final:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return window[len(done) :]


class StopStrings:
    """The OpenAI stop-string rule over a turn's growing text.

    :meth:`feed` appends text and returns ``(text safe to send, the stop string found or None)``;
    once a stop string is found the text ends before it (or after it with ``include``) and
    :attr:`cut` holds what was dropped (the stop string unless included, and anything after it).
    The longest tail that is a proper prefix of some stop string is held back until it completes
    or cannot; :meth:`flush` releases it at the end of the turn. ``check=False`` (before
    ``min_tokens``) appends without looking for a stop string ending in the new text.
    """

    def __init__(self, stop: Sequence[str], include: bool = False):
        self.stop = [s for s in stop if s]
        self.include = include
        self.longest = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.sent = 0
        self.cut = ""
        self.matched: str | None = None

    def feed(self, piece: str, check: bool = True) -> tuple[str, str | None]:
        if self.matched is not None:
            self.cut += piece
            return "", self.matched
        old = len(self.text)
        self.text += piece
        if check and self.stop:
            # only a stop string that ends in the new text: earlier ones were checked (or not due)
            hits = [
                (i, -len(s), s) for s in self.stop if (i := self.text.find(s, max(0, old - len(s) + 1))) >= 0
            ]
            if hits:
                i, _, stop = min(hits)
                end = i + len(stop) if self.include else i
                self.cut, self.text, self.matched = self.text[end:], self.text[:end], stop
                return self._release(len(self.text)), stop
        return self._release(len(self.text) - self._held()), None

    def flush(self) -> str:
        return self._release(len(self.text))

    def _held(self) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop string."""
        tail = self.text[self.sent :]
        for n in range(min(len(tail), self.longest - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stop):
                return n
        return 0

    def _release(self, end: int) -> str:
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 bytes (``bytes_to_unicode``), inverted."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # heavy: only when asked

    return {char: byte for byte, char in bytes_to_unicode().items()}


_DECODER_TYPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tokenizer_facts(tokenizer) -> tuple[set[str], frozenset[int]]:
    """The types in a fast tokenizer's decoder pipeline (``ByteLevel``, ``ByteFallback``, ...) and
    its special token ids, read once per tokenizer (token_bytes runs per logprob entry)."""
    if tokenizer not in _DECODER_TYPES:
        special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        _DECODER_TYPES[tokenizer] = (_read_decoder_types(tokenizer), special)
    return _DECODER_TYPES[tokenizer]


def _read_decoder_types(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    found, stack = set(), [decoder]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.add(node.get("type"))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes token ``token_id`` stands for, which may be part of a UTF-8 character (the OpenAI
    logprobs ``bytes`` field: the bytes of the tokens of one character join back into it).

    Byte-level BPE (GPT-2, Llama 3, SmolLM2): the token's printable stand-ins mapped back to bytes.
    SentencePiece byte fallback (Llama 2, Mistral): ``<0xAB>`` is the byte 0xAB and ``▁`` a space.
    A special token (and any other tokenizer): the UTF-8 bytes of its decoded text.
    """
    kinds, special = _tokenizer_facts(tokenizer)
    if token_id in special:
        return tokenizer.decode([token_id]).encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()
        if all(ch in alphabet for ch in piece):
            return bytes(alphabet[ch] for ch in piece)
    if "ByteFallback" in kinds or "\u2581" in piece:
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")
    return tokenizer.decode([token_id]).encode("utf-8")
