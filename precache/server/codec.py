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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens, such as a BOS, when
        ``add_special_tokens``).

        Raises:
            APIError: 400, the model has no tokenizer.
        """
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
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
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        options = {"add_generation_prompt": True, **(options or {})}
        with self._lock:
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
            except Exception as exc:  # jinja raises its own errors for messages a template refuses
                raise APIError(400, f"the chat template refused the request: {exc}", "messages") from exc
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], **options) -> str:
        """Text of ``token_ids`` (``options``: the tokenizer's decode options)."""
        with self._lock:
            return self.engine.decode(token_ids, **options)

    def token_string(self, token_id: int, as_id: bool = False) -> str:
        """A token's own text for log-probabilities (``token_id:<id>`` with ``as_id``, vLLM's
        ``return_tokens_as_token_ids``)."""
        return f"token_id:{token_id}" if as_id else self.decode([token_id])
