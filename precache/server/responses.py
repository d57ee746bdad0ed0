"""OpenAI response bodies and stream chunks (``text_completion``, ``chat.completion``,
``chat.completion.chunk``) with ``n`` choices and log-probabilities in the OpenAI shapes.

The text itself comes from the engine (:class:`~precache.engine.outputs.StreamChunk` pieces and
:attr:`Turn.text`, already by the OpenAI stop rule and whole characters only), so streamed and
non-streamed answers are the same text as ``Session.generate``.
"""

from __future__ import annotations

import json
import time
import uuid

from precache.engine.outputs import TokenLogprob, Turn
from precache.server.jobs import finish_reason
from precache.server.tool_parsers import ToolParser
from precache.server.tools import ToolRequest


def sse(obj: dict | str) -> str:
    """One server-sent event: ``data: <json>`` (or a literal such as ``[DONE]``)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def usage(turns: list[Turn], per_prompt: int | None = None) -> dict:
    """Token counts of a request: each prompt once (its ``per_prompt`` choices, consecutive in
    ``turns``, share its cache; default: one prompt), every choice's tokens;
    ``prompt_tokens_details.cached_tokens`` = prompt tokens served from the cache."""
    firsts = turns[:: per_prompt or len(turns)]
    prompt = sum(t.prompt_tokens for t in firsts)
    completion = sum(t.new_tokens for t in turns)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(t.cached_tokens for t in firsts)},
    }


def _finish_reason(turn: Turn, calls: list, tools: ToolRequest | None) -> str:
    """OpenAI's: ``length`` when ``max_tokens`` ended the answer (complete calls before a cut one
    are still returned); ``tool_calls`` when it holds calls, except for a named ``tool_choice``,
    which ends with ``stop`` (as OpenAI and vLLM); else ``stop``."""
    reason = finish_reason(turn)
    if reason == "length" or not calls or (tools is not None and tools.choice == "function"):
        return reason
    return "tool_calls"


class Renderer:
    """Bodies of one response: ``kind`` is ``"chat"`` or ``"completion"``; ``model`` the name the
    client asked for; ``codec`` turns token ids into the strings of log-probabilities
    (``tokens_as_ids``: ``token_id:<id>``, vLLM's ``return_tokens_as_token_ids``); ``echo`` the text
    put before every choice's answer; ``request_id`` names the response (vLLM's field; default a
    random id). ``return_token_ids`` adds the prompt and output token ids (a vLLM extension)."""

    def __init__(
        self,
        kind: str,
        model: str,
        prompt_ids: list[int],
        codec,
        *,
        return_token_ids: bool = False,
        tokens_as_ids: bool = False,
        echo: str = "",
        request_id: str | None = None,
        choices_per_prompt: int | None = None,
        tool_parser: ToolParser | None = None,
        tools: ToolRequest | None = None,
    ):
        self.kind, self.model, self.prompt_ids, self.codec = kind, model, prompt_ids, codec
        self.return_token_ids, self.tokens_as_ids, self.echo = return_token_ids, tokens_as_ids, echo
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id, self.created = f"{prefix}-{request_id or uuid.uuid4().hex}", int(time.time())
        self._offsets: dict[int, int] = {}  # completion text offset per choice, for streamed logprobs
        self.per_prompt = choices_per_prompt  # several prompts: choices i*n .. i*n+n-1 answer prompt i
        self.tool_parser = tool_parser  # tools may be called: answers are parsed, streams held back
        self.tools = tools

    def _head(self, chunk: bool) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- log-probabilities ---------------------------------------------------------------------
    def logprobs(self, entries: list[TokenLogprob] | None, index: int = 0, start: int = 0) -> dict | None:
        """The ``logprobs`` object of a choice (None when not asked for): chat's ``content`` list,
        or completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` with
        offsets from ``start`` characters."""
        if entries is None:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens = [self._token(e.token_id) for e in entries]
        offsets, at = [], start
        for token in tokens:
            offsets.append(at)
            at += len(token)
        self._offsets[index] = at
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(i): v for i, v in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _token(self, token_id: int) -> str:
        return self.codec.token_string(token_id, self.tokens_as_ids)

    def _chat_entry(self, e: TokenLogprob) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            token = self._token(token_id)
            return {"token": token, "logprob": logprob, "bytes": self.codec.token_bytes(token_id)}

        return {**one(e.token_id, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]}

    # -- whole responses -----------------------------------------------------------------------
    def _choice(self, index: int, text: str | None, turn: Turn | None, chunk: bool, logprobs) -> dict:
        choice: dict = {"index": index}
        calls: list = []
        if self.kind == "chat" and self.tool_parser is not None and turn is not None:
            # the whole answer: its text outside the calls, and the calls (a stream sends them once)
            choice_kind = self.tools.choice if self.tools is not None else "auto"
            content, calls = self.tool_parser.parse(turn.text, forced=choice_kind != "auto")
            if self.tools is not None and not self.tools.parallel:
                calls = calls[:1]  # vLLM's rule: the first call only
            if chunk:  # the stream's first chunk carried the echo
                delta = {} if content is None else {"content": content}
                if calls:
                    delta["tool_calls"] = [c.openai(index=k) for k, c in enumerate(calls)]
                choice["delta"] = delta
            else:
                content = self.echo + (content or "") if self.echo or content else None
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = [c.openai() for c in calls]
        elif self.kind == "chat" and chunk:
            choice["delta"] = {} if text is None else {"content": text}
        elif self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text or ""
        reason = None if turn is None else _finish_reason(turn, calls, self.tools)
        choice.update(logprobs=logprobs, finish_reason=reason)
        if turn is not None:
            choice["stop_reason"] = turn.matched_stop  # vLLM's: the stop string or token id, or None
            if self.return_token_ids:
                choice["token_ids"] = list(turn.token_ids)
        return choice

    def body(self, turns: list[Turn]) -> dict:
        """The whole (non-streamed) response, one choice per turn."""
        choices = [
            self._choice(i, self.echo + t.text, t, False, self.logprobs(t.logprobs, i, len(self.echo)))
            for i, t in enumerate(turns)
        ]
        out = {**self._head(False), "choices": choices, "usage": usage(turns, self.per_prompt)}
        out.update(self._sessions(turns))
        if self.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    # -- streams -------------------------------------------------------------------------------
    def first_chunks(self, n: int) -> list[dict]:
        """The chat stream opens each choice with the assistant role (and the echoed text);
        completions open with the echoed prompt only."""
        out = []
        for index in range(n):
            self._offsets[index] = len(self.echo)
            if self.kind == "chat":
                choice = {"index": index, "delta": {"role": "assistant", "content": self.echo}}
                out.append(
                    {**self._head(True), "choices": [{**choice, "logprobs": None, "finish_reason": None}]}
                )
            elif self.echo:
                out.append(self.chunk(index, self.echo, None))
        return out

    def chunk(self, index: int, text: str, entries: list[TokenLogprob] | None) -> dict | None:
        """A chunk of choice ``index``'s text; None while tools may be called (the answer goes out
        whole in :meth:`last_chunk`, parsed into content and tool calls)."""
        if self.tool_parser is not None:
            return None
        lp = self.logprobs(entries, index, self._offsets.get(index, 0)) if entries is not None else None
        return {**self._head(True), "choices": [self._choice(index, text, None, True, lp)]}

    def last_chunk(self, index: int, turn: Turn, entries: list[TokenLogprob] | None) -> dict:
        """The chunk with a choice's finish reason (and its last log-probabilities, the session id
        (our extension) and, when asked for, every output token id)."""
        lp = self.logprobs(entries, index, self._offsets.get(index, 0)) if entries is not None else None
        choice = self._choice(index, None if self.kind == "chat" else "", turn, True, lp)
        return {**self._head(True), "choices": [choice], "session_id": turn.session_id}

    def usage_chunk(self, turns: list[Turn]) -> dict:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        return {**self._head(True), "choices": [], "usage": usage(turns, self.per_prompt)}

    def _sessions(self, turns: list[Turn]) -> dict:
        """Our extension: ``session_id`` of the trajectory the answer continues (its choice 0), or
        with several prompts ``session_ids``, one per prompt."""
        firsts = turns[:: self.per_prompt or len(turns)]
        if len(firsts) == 1:
            return {"session_id": firsts[0].session_id}
        return {"session_ids": [t.session_id for t in firsts]}
