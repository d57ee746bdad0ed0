"""Text <-> token ids for the server, safe to call from the event loop and the scheduler thread.

HF fast tokenizers are Rust objects that may refuse concurrent use from two threads ("Already
borrowed"), so every call goes through the engine's tokenizer lock (the server loop decodes under
it too). The handlers call it off the event loop; a text far longer than the context could ever
hold is refused before it is tokenised (:meth:`Codec.check_length`).

Chat content and role injection: a message's content is text. Strings in it that spell one of the
tokenizer's added tokens (``<|im_start|>``, ``<|im_end|>``, ...) are replaced by private markers
before the template renders, and each marker becomes the tokens of that string read as plain text
(``split_special_tokens``), so control tokens come from the template alone. Content without such
strings is tokenised exactly as before. ``trust_special`` keeps the old behaviour for trusted
clients.
"""

from __future__ import annotations

import math
import re
import secrets

from precache.engine.engine import TOKENIZER_LOCK
from precache.server.errors import APIError


class Codec:
    """The engine's tokenizer behind a lock. A model without a tokenizer accepts token-id prompts
    only; its text is the ids joined by spaces (:meth:`Engine.decode`)."""

    def __init__(self, engine, trust_special: bool = False):
        self.engine, self.trust_special = engine, trust_special
        self.tokenizer = engine.tokenizer
        self._lock = TOKENIZER_LOCK
        self._specials: list[str] = []
        self._longest = 1  # characters of the longest token: a text of c characters has >= c / this tokens
        if self.tokenizer is not None:
            added = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True)
            self._specials = [t for t in added if t]
            self._longest = max(map(len, self.tokenizer.get_vocab()), default=1)

    def check_length(self, text: str, param: str) -> None:
        """Refuse, before tokenising it, a text that has more tokens than the context length for
        sure (more characters than ``max_context`` times the longest token's).

        Raises:
            APIError: 400 ``context_length_exceeded`` naming ``param``.
        """
        limit = self.engine.max_context
        at_least = math.ceil(len(text) / self._longest)
        if at_least > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens; the {param} has {len(text)} "
                f"characters, at least {at_least} tokens",
                param,
                "context_length_exceeded",
            )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens, such as a BOS, when
        ``add_special_tokens``).

        Raises:
            APIError: 400, the model has no tokenizer.
        """
        if self.tokenizer is None:
            raise APIError(
                400, "this model has no tokenizer: send the prompt as token ids", "prompt", "no_tokenizer"
            )
        self.check_length(text, "prompt")
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat(
        self, messages: list[dict], options: dict | None = None, add_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the tokenizer's chat template; ``options`` go to
        ``apply_chat_template`` (default: the assistant's generation prompt).

        Raises:
            APIError: 400, no chat template, or the template refuses the messages or options.
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                400, "this model has no chat template: use /v1/completions", "messages", "no_chat_template"
            )
        options = {"add_generation_prompt": True, **(options or {})}
        markers: dict[str, str] = {}
        if not self.trust_special:
            messages = [self._escape(m, markers) for m in messages]
        with self._lock:
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
            except Exception as exc:  # jinja raises its own errors for messages a template refuses
                raise APIError(
                    400, f"the chat template refused the request: {exc}", "messages", "chat_template_error"
                ) from exc
        self.check_length(text, "messages")
        with self._lock:
            if not markers:
                return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
            return self._encode_marked(text, markers, add_special_tokens)

    def _escape(self, message: dict, markers: dict[str, str]) -> dict:
        """``message`` with every added-token string in its text fields (all but ``role``) replaced
        by a marker of this request (``markers``: marker -> the string it stands for)."""
        out = {}
        for key, value in message.items():
            if key != "role" and isinstance(value, str) and any(t in value for t in self._specials):
                pattern = "|".join(re.escape(t) for t in self._specials)
                value = re.sub(pattern, lambda m: self._marker(m.group(0), markers), value)
            out[key] = value
        return out

    @staticmethod
    def _marker(special: str, markers: dict[str, str]) -> str:
        for marker, text in markers.items():
            if text == special:
                return marker
        marker = f"\ue000{secrets.token_hex(8)}\ue001"  # private-use code points, random per request
        markers[marker] = special
        return marker

    def _encode_marked(self, text: str, markers: dict[str, str], add_special_tokens: bool) -> list[int]:
        """Tokens of rendered ``text``: the pieces between markers as usual, each marker as the
        tokens of its string read as text (``split_special_tokens=True``)."""
        pieces = re.split("(" + "|".join(map(re.escape, markers)) + ")", text)
        ids: list[int] = []
        for piece in pieces:
            if piece in markers:
                ids += self.tokenizer.encode(
                    markers[piece], add_special_tokens=False, split_special_tokens=True
                )
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return list(self.tokenizer.build_inputs_with_special_tokens(ids)) if add_special_tokens else ids

    def decode(self, token_ids: list[int], **options) -> str:
        """Text of ``token_ids`` (``options``: the tokenizer's decode options)."""
        with self._lock:
            return self.engine.decode(token_ids, **options)

    def token_string(self, token_id: int, as_id: bool = False) -> str:
        """A token's own text for log-probabilities (``token_id:<id>`` with ``as_id``, vLLM's
        ``return_tokens_as_token_ids``)."""
        return f"token_id:{token_id}" if as_id else self.decode([token_id])

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes the token stands for (the OpenAI logprobs ``bytes``: the tokens of one character
        join back into its UTF-8 bytes, where the token's text alone is U+FFFD)."""
        with self._lock:
            return list(self.engine.token_bytes(token_id))
