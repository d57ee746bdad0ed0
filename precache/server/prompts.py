"""A request's prompt as token ids: ``/v1/completions`` text or ids, ``/v1/chat/completions``
messages rendered by the chat template with vLLM's template options, and what ``echo`` repeats;
all through one :class:`Codec` (text <-> token ids), safe to call from the event loop and the
scheduler thread.

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
from typing import Literal

from precache.engine.engine import TOKENIZER_LOCK
from precache.server.errors import APIError
from precache.server.protocol import MAX_N, ChatRequest, CompletionRequest
from precache.server.tool_parsers import ToolParser, get_parser
from precache.server.tools import ToolRequest, renders_tools, tool_messages, tool_request


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


def completion_prompts(req: CompletionRequest, codec, vocab_size: int) -> list[list[int]]:
    """Token ids of each of the request's prompts (``prompt`` is one text or token-id list, or a list
    of them: one response with ``n`` choices per prompt, numbered prompt by prompt, as OpenAI);
    text is tokenised with the tokenizer's special tokens (a BOS) unless ``add_special_tokens`` is
    false (vLLM's default: true).

    Raises:
        APIError: 400, an empty prompt, token ids outside ``[0, vocab_size)``, more than
            ``MAX_N`` choices in all, or several prompts with ``echo``, ``return_token_ids`` or
            ``session_id`` (each names one prompt).
    """
    prompt = req.prompt
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    prompts = list(prompt) if several else [prompt]
    if len(prompts) * req.n > MAX_N:
        raise APIError(
            400,
            f"prompt: {len(prompts)} prompts x n={req.n} choices is more than {MAX_N} choices in one request",
            "prompt",
            "invalid_value",
        )
    if len(prompts) > 1:
        for field, on in (
            ("echo", req.echo),
            ("return_token_ids", req.return_token_ids),
            ("session_id", req.session_id is not None),
        ):
            if on:
                raise APIError(
                    400,
                    f"{field}: not supported with several prompts (send one prompt per request)",
                    field,
                    "unsupported_parameter",
                )
    return [_prompt_ids(p, req, codec, vocab_size) for p in prompts]


def _prompt_ids(prompt: str | list[int], req: CompletionRequest, codec, vocab_size: int) -> list[int]:
    if not prompt:
        raise APIError(400, "the prompt is empty", "prompt", "empty_prompt")
    if isinstance(prompt, str):
        return codec.encode(prompt, add_special_tokens=req.add_special_tokens)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400, f"token ids must be in [0, {vocab_size}), got {bad[:5]}", "prompt", "invalid_value"
        )
    return list(prompt)


def chat_messages(req: ChatRequest) -> list[dict]:
    """The messages as the chat template takes them: every field the client sent (``name``,
    ``tool_calls``, ...), content parts joined (text parts only).

    Raises:
        APIError: 400, no messages or a non-text content part.
    """
    if not req.messages:
        raise APIError(400, "messages is empty", "messages", "empty_prompt")
    out = []
    for i, m in enumerate(req.messages):
        message = m.model_dump(exclude_none=True)
        content = m.content or ""
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(
                    400,
                    "only text content parts are supported",
                    f"messages[{i}].content",
                    "unsupported_content",
                )
            content = "".join(part.text or "" for part in content)
        message["content"] = content
        out.append(message)
    return out


def chat_prompt(
    req: ChatRequest,
    codec,
    parser: ToolParser | None = None,
    tools: ToolRequest | None | Literal["from-request"] = "from-request",
) -> list[int]:
    """Token ids of the conversation rendered by the model's chat template with the request's
    ``add_generation_prompt``, ``continue_final_message``, ``documents`` and
    ``chat_template_kwargs`` (vLLM's options) and its tools (:func:`~precache.server.tools.tool_messages`
    in ``parser``'s format, default hermes; ``tools`` as :func:`~precache.server.tools.tool_request`
    reads them from the request unless given), tokenised with special tokens only when
    ``add_special_tokens`` (default false: the template writes them).

    Raises:
        APIError: 400, no messages, no chat template, or the template refuses the request.
    """
    options = dict(req.chat_template_kwargs or {})
    clash = {"add_generation_prompt", "continue_final_message", "documents", "tokenize", "chat_template"}
    clash &= set(options)
    if clash:
        name = sorted(clash)[0]
        raise APIError(
            400, f"chat_template_kwargs: set {name} as a request field, not here", "chat_template_kwargs"
        )
    options.update(
        add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message
    )
    if req.documents is not None:
        options["documents"] = req.documents
    if tools == "from-request":
        tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    messages, extra = tool_messages(
        chat_messages(req), tools, parser or get_parser("hermes"), renders_tools(codec.tokenizer)
    )
    options.update(extra)
    return codec.chat(messages, options, add_special_tokens=req.add_special_tokens)


def echo_text(req: CompletionRequest | ChatRequest, prompt_ids: list[int], codec) -> str:
    """What ``echo`` puts before the answer: a completion's prompt text; in chat, the last
    message's content when it has the answer's role (vLLM's rule: the assistant's with
    ``add_generation_prompt``, else the last message's own role, so always)."""
    if not req.echo:
        return ""
    if isinstance(req, CompletionRequest):
        return codec.decode(prompt_ids)
    last = req.messages[-1]
    if req.add_generation_prompt and last.role != "assistant":
        return ""
    content = last.content or ""
    return content if isinstance(content, str) else "".join(p.text or "" for p in content)
