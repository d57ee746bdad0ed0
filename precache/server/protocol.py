"""OpenAI request bodies, the policy over every field vLLM's OpenAI server accepts (honoured,
refused with a 400 naming it, or ignored and logged when it cannot change the output), and the
request's :class:`SamplingParams`.

Every refusal is an :class:`APIError` 400 whose ``param`` names the field, raised before the request
is queued; what depends on the engine (the context length, token ids, the constraint compiling) is
the engine's own check (:mod:`precache.engine.validation`), its typed error mapped by
:func:`~precache.server.errors.engine_refusal`. Extensions: vLLM's (through the client's ``extra_body``: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``,
...) and ours: ``session_id`` pins a trajectory. docs/server.md, "Request fields", lists every
field.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from precache.config import SamplingParams
from precache.engine.validation import check_room, check_token_ids
from precache.server.errors import APIError, engine_checks, quote, refuse, validation_error
from precache.server.fields import IGNORED, REFUSED
from precache.server.shapes import (
    ChatMessage,
    Regex,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolChoice,
    structured_output,
)

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_N = 128  # choices per request: each is a trajectory of its own
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit signed integer, as vLLM's seed field
MAX_SALT_CHARS = 1024
MAX_ID_CHARS = 256  # session_id and request_id: echoed in responses
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")  # ASCII digits, no sign, no leading zero, no space


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    session_id: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    request_id: str | None = None
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    tool_choice: ToolChoice | None = None
    # vLLM's structured outputs (the older guided_* fields and the newer structured_outputs object)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Regex | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def top_logprobs_asked(self) -> int | None:
        """How many top log-probabilities each token returns (None: no logprobs)."""
        raise NotImplementedError


class CompletionRequest(_GenerationRequest):
    """``/v1/completions``: ``prompt`` is text or token ids (one prompt per request)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # true is not token id 1
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class ChatRequest(_GenerationRequest):
    """``/v1/chat/completions``: ``messages`` rendered by the tokenizer's chat template, with vLLM's
    template options."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    parallel_tool_calls: bool | None = None

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_Request = TypeVar("_Request", bound=_GenerationRequest)


def parse_request(cls: type[_Request], body: Any) -> _Request:
    """``body`` (plain JSON data) as request model ``cls`` (:class:`ChatRequest`,
    :class:`CompletionRequest`), as the routes read it.

    Raises:
        APIError: 400 whose ``param`` is the path of the field at fault
            (:func:`~precache.server.errors.validation_error`).
    """
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def check_unicode(value: Any, path: str = "") -> None:
    """Refuse a string anywhere in ``value`` (a request body as plain data: dicts, lists, strings)
    that is not valid Unicode text: a lone UTF-16 surrogate (JSON ``"\\ud800"``), which no tokenizer
    can encode.

    Raises:
        APIError: 400 ``invalid_unicode`` naming the field.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(
                400,
                f"{path or 'body'}: invalid Unicode (a lone surrogate at character {exc.start})",
                path or None,
                "invalid_unicode",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            name = f"{path}.{key}" if path else str(key)
            check_unicode(key, name)
            check_unicode(item, name)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}[{i}]")


def check_fields(req: _GenerationRequest) -> None:
    """Apply the field policy: an unknown field or a refused one (not at its no-op value) is a
    400 naming it; an ignored one is logged.

    Raises:
        APIError: 400 with ``param`` = the field.
    """
    for name in ("session_id", "request_id"):
        value = getattr(req, name)
        if value is not None and not 0 < len(value) <= MAX_ID_CHARS:
            raise refuse(
                name,
                f"{name} must be a non-empty string of at most {MAX_ID_CHARS} characters",
                "invalid_value",
            )
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_SALT_CHARS:
        raise refuse(
            "cache_salt",
            f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters",
            "invalid_value",
        )
    for name, value in (req.model_extra or {}).items():
        if name in IGNORED:
            logger.debug("request field %r ignored: it cannot change the output", name)
        elif name in REFUSED:
            accepted, why = REFUSED[name]
            if not any(value == ok and type(value) is type(ok) for ok in accepted):
                raise refuse(name, why)
        else:
            raise refuse(name, "unknown field (docs/server.md lists the supported ones)", "unknown_parameter")
    if isinstance(req, CompletionRequest) and req.tool_choice not in (None, "none"):
        raise refuse("tool_choice", "tool calling needs /v1/chat/completions")
    if req.stream_options is not None:
        if not req.stream:
            raise refuse("stream_options", "stream_options needs stream=true", "invalid_value")
        if req.stream_options.continuous_usage_stats:
            raise refuse("stream_options", "continuous_usage_stats is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise refuse(
            "best_of", f"best_of must equal n ({req.n}): choosing the best of more samples is not supported"
        )
    if isinstance(req, ChatRequest):
        _check_chat(req)
    elif req.echo and req.logprobs is not None:
        raise refuse("echo", "echo with logprobs needs prompt log-probabilities, which are not computed")


def _check_chat(req: ChatRequest) -> None:
    if req.continue_final_message and req.add_generation_prompt:
        raise refuse(
            "continue_final_message",
            "cannot set both continue_final_message and add_generation_prompt to true",
            "invalid_value",
        )
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise refuse("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "invalid_value")
    if req.top_logprobs and not req.logprobs:
        raise refuse("top_logprobs", "when using top_logprobs, logprobs must be set to true", "invalid_value")
    if req.echo and req.logprobs:
        raise refuse("echo", "echo with logprobs needs prompt log-probabilities, which are not computed")


def max_tokens_field(req: _GenerationRequest) -> tuple[str, int | None]:
    """``(field name, value)`` of the output budget the request set (chat: ``max_completion_tokens``
    before the deprecated ``max_tokens``)."""
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens


def checked_params(
    req: _GenerationRequest, prompts: list[list[int]], max_context: int, vocab_size: int
) -> SamplingParams:
    """The request's :class:`SamplingParams` for its ``prompts`` (token ids; a completion's default
    budget is OpenAI's 16 tokens, a chat's the room its prompt leaves), checked by the engine
    (:mod:`precache.engine.validation`): each prompt leaves room for a token, then for the budget
    (vLLM refuses a prompt plus ``max_tokens`` past the context, never clamps it), and the token ids
    lie in the vocabulary.

    Raises:
        APIError: 400 naming the field (an engine check's typed error mapped by
            :func:`~precache.server.errors.engine_refusal`).
    """
    with engine_checks():
        for ids in prompts:
            check_room(len(ids), max_context)
    completion = isinstance(req, CompletionRequest)
    params = sampling_params(
        req, COMPLETION_DEFAULT_MAX_TOKENS if completion else max_context - len(prompts[0])
    )
    with engine_checks():
        for ids in prompts:
            check_room(len(ids), max_context, params.max_new_tokens, param=max_tokens_field(req)[0])
        check_token_ids(params, vocab_size)
    return params


def sampling_params(req: _GenerationRequest, default_max_tokens: int) -> SamplingParams:
    """The request's sampling fields as engine parameters (OpenAI defaults: temperature 1, top_p 1),
    built once per request; the caller ran :func:`check_fields` (the field policy) first.

    Raises:
        APIError: 400 naming the field that is refused or out of range.
    """
    name, max_tokens = max_tokens_field(req)
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise refuse(name, f"{name} must be at least 1, got {max_tokens}", "invalid_value")
    if not 1 <= req.n <= MAX_N:
        raise refuse("n", f"n must be in [1, {MAX_N}], got {req.n}", "invalid_value")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise refuse("seed", f"seed must be a 64-bit signed integer, got {req.seed}", "invalid_value")
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    ):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            raise refuse(name, f"{name} must be a finite number, got {value}", "invalid_value")
    top = req.top_logprobs_asked()
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise refuse("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "invalid_value")
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key):  # one spelling per id: no "05", " 5" or full-width digits
            raise refuse(
                "logit_bias", f"keys must be token ids in decimal, got {quote(key)}", "invalid_value"
            )
        bias[int(key)] = float(value)
    fields = {
        "max_new_tokens": max_tokens,
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": req.top_k or 0,
        "min_p": req.min_p or 0.0,
        "stop": (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "logit_bias": tuple(bias.items()),
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "presence_penalty": req.presence_penalty or 0.0,
        "logprobs": top,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "structured_output": structured_output(req),
    }
    try:
        return SamplingParams(**fields)
    except ValueError as exc:  # the message starts with the field's name
        field = str(exc).split(" ", 1)[0]
        param = {"max_new_tokens": name}.get(field, field)
        raise refuse(param, str(exc), "invalid_value") from None
