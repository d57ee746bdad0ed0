"""OpenAI request bodies and their validation into token ids and :class:`SamplingParams`.

Every refusal is an :class:`APIError` 400 naming the field, raised before the request is queued.
Extensions (vLLM spellings, via the client's ``extra_body``): ``top_k``, ``ignore_eos``,
``return_token_ids``; and ours: ``session_id`` pins a trajectory.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from precache.config import SamplingParams
from precache.server.errors import APIError

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    session_id: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


class CompletionRequest(_GenerationRequest):
    """``/v1/completions``: ``prompt`` is text or token ids (one prompt per request)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None


class ChatRequest(_GenerationRequest):
    """``/v1/chat/completions``: ``messages`` rendered by the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def sampling_params(req: _GenerationRequest, default_max_tokens: int) -> SamplingParams:
    """The request's sampling fields as engine parameters (OpenAI defaults: temperature 1, top_p 1).

    Raises:
        APIError: 400 naming the field out of range (max_tokens < 1, temperature outside [0, 2],
        top_p outside (0, 1], top_k < -1, n != 1, logprobs or echo asked for).
    """
    max_tokens = getattr(req, "max_completion_tokens", None)
    max_tokens = req.max_tokens if max_tokens is None else max_tokens
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    checks = [
        (max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {max_tokens}"),
        (0.0 <= temperature <= 2.0, "temperature", f"temperature must be in [0, 2], got {temperature}"),
        (0.0 < top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {top_p}"),
        (req.top_k is None or req.top_k >= -1, "top_k", f"top_k must be -1, 0 or positive, got {req.top_k}"),
        (req.n == 1, "n", f"only n=1 is supported, got {req.n}"),
        (not req.logprobs, "logprobs", "logprobs are not supported"),
        (not getattr(req, "echo", False), "echo", "echo is not supported"),
    ]
    for ok, param, message in checks:
        if not ok:
            raise APIError(400, message, param, "invalid_value")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(s for s in req.stop or () if s)
    return SamplingParams(
        max_tokens, temperature, top_p, max(0, req.top_k or 0), stop, req.seed, ignore_eos=req.ignore_eos
    )


def completion_prompt(req: CompletionRequest, codec, vocab_size: int) -> list[int]:
    """Token ids of the request's single prompt (text is tokenised without special tokens).

    Raises:
        APIError: 400, empty prompt, several prompts, or token ids outside ``[0, vocab_size)``.
    """
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(400, f"send one prompt per request, got {len(prompt)}", "prompt", "invalid_value")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "the prompt is empty", "prompt", "empty_prompt")
    if isinstance(prompt, str):
        return codec.encode(prompt)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400, f"token ids must be in [0, {vocab_size}), got {bad[:5]}", "prompt", "invalid_value"
        )
    return list(prompt)


def chat_prompt(req: ChatRequest, codec) -> list[int]:
    """Token ids of the conversation rendered by the chat template, ending with the assistant's
    generation prompt. Content parts are joined (text parts only).

    Raises:
        APIError: 400, no messages, a non-text content part, or no chat template.
    """
    if not req.messages:
        raise APIError(400, "messages is empty", "messages", "empty_prompt")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content or ""
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(400, "only text content parts are supported", f"messages.{i}.content")
            content = "".join(part.text or "" for part in content)
        messages.append({"role": m.role, "content": content})
    return codec.chat(messages)


def check_prompt(ids: list[int], max_context: int) -> None:
    """Refuse a prompt with no tokens or no room for one new token (400)."""
    if not ids:
        raise APIError(400, "the prompt has no tokens", "prompt", "empty_prompt")
    if len(ids) >= max_context:
        raise APIError(
            400,
            f"this model's maximum context length is {max_context} tokens; the prompt has {len(ids)} "
            f"tokens, which leaves no room to generate",
            "prompt",
            "context_length_exceeded",
        )
