"""Text <-> token ids for the server, safe to call from the event loop and the scheduler thread.

HF fast tokenizers are Rust objects that may refuse concurrent use from two threads ("Already
borrowed"), so every call goes through the engine's tokenizer lock (the server loop decodes under
it too); each call takes microseconds.
"""

from __future__ import annotations

from precache.engine.engine import TOKENIZER_LOCK
from precache.server.errors import APIError


class Codec:
    """The engine's tokenizer behind a lock. A model without a tokenizer accepts token-id prompts
    only; its text is the ids joined by spaces (:meth:`Engine.decode`)."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._lock = TOKENIZER_LOCK

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added.

        Raises:
            APIError: 400, the model has no tokenizer.
        """
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered by the tokenizer's chat template, with the generation
        prompt of the assistant's turn.

        Raises:
            APIError: 400, no chat template, or the template refuses the messages.
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        with self._lock:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as exc:  # jinja raises its own errors for messages a template refuses
                raise APIError(400, f"the chat template refused the messages: {exc}", "messages") from exc
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        with self._lock:
            return self.engine.decode(token_ids)

    def decode_piece(self, token_ids: list[int]) -> str:
        """Text the last token of ``token_ids`` adds."""
        with self._lock:
            return self.engine.decode_piece(token_ids)
