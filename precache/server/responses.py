"""OpenAI response bodies and stream chunks (``text_completion``, ``chat.completion``,
``chat.completion.chunk``), and the trimming of stop strings out of the returned text."""

from __future__ import annotations

import json
import time
import uuid

from precache.engine.request import Turn
from precache.server.jobs import finish_reason


def sse(obj: dict | str) -> str:
    """One server-sent event: ``data: <json>`` (or a literal such as ``[DONE]``)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def usage(turn: Turn) -> dict:
    """Token counts, with ``prompt_tokens_details.cached_tokens`` = prompt tokens served from the cache."""
    return {
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": turn.new_tokens,
        "total_tokens": turn.prompt_tokens + turn.new_tokens,
        "prompt_tokens_details": {"cached_tokens": turn.cached_tokens},
    }


class Renderer:
    """Bodies of one response: ``kind`` is ``"chat"`` or ``"completion"``; ``model`` the name the
    client asked for. ``return_token_ids`` adds the prompt and output token ids (a vLLM extension)."""

    def __init__(self, kind: str, model: str, prompt_ids: list[int], return_token_ids: bool = False):
        self.kind, self.model, self.prompt_ids = kind, model, prompt_ids
        self.return_token_ids = return_token_ids
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())

    def _head(self, chunk: bool) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish_reason: str | None, chunk: bool) -> dict:
        choice: dict = {"index": 0}
        if self.kind == "chat" and chunk:
            choice["delta"] = {} if text is None else {"content": text}
        elif self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text or ""
        choice.update(logprobs=None, finish_reason=finish_reason)
        return choice

    def body(self, text: str, turn: Turn) -> dict:
        """The whole (non-streamed) response."""
        choice = self._choice(text, finish_reason(turn), chunk=False)
        if self.return_token_ids:
            choice["token_ids"] = list(turn.token_ids)
        out = {**self._head(False), "choices": [choice], "usage": usage(turn), "session_id": turn.session_id}
        if self.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def first_chunk(self) -> dict | None:
        """The chat stream opens with the assistant role; completions have no opening chunk."""
        if self.kind != "chat":
            return None
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return {**self._head(True), "choices": [choice]}

    def chunk(self, text: str) -> dict:
        return {**self._head(True), "choices": [self._choice(text, None, chunk=True)]}

    def last_chunk(self, turn: Turn) -> dict:
        """The chunk with the finish reason, the session id (our extension) and, when asked for,
        every output token id."""
        choice = self._choice(None if self.kind == "chat" else "", finish_reason(turn), chunk=True)
        if self.return_token_ids:
            choice["token_ids"] = list(turn.token_ids)
        return {**self._head(True), "choices": [choice], "session_id": turn.session_id}

    def usage_chunk(self, turn: Turn) -> dict:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        return {**self._head(True), "choices": [], "usage": usage(turn)}


class StopTrimmer:
    """Streamed text with the stop strings cut out (OpenAI returns text up to, not including, the
    first stop string; the engine stops right after the token that completes it).

    :meth:`feed` holds back the last ``len(longest stop) - 1`` characters, which could start a stop
    string; :meth:`flush` releases what is left at the end of the turn.
    """

    def __init__(self, stop: tuple[str, ...]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text, self.sent, self.cut = "", 0, None

    def feed(self, piece: str) -> str:
        """Append ``piece``; return the text that is now safe to send."""
        self.text += piece
        if self.cut is None:
            # a stop string not yet complete before this piece starts at or after ``sent``
            hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
            self.cut = min(hits) if hits else None
        return self._release(len(self.text) - self.hold)

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        end = min(end, self.cut) if self.cut is not None else end
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out
