"""A request's prompt as token ids: ``/v1/completions`` text or ids, ``/v1/chat/completions``
messages rendered by the chat template with vLLM's template options, and what ``echo`` repeats."""

from __future__ import annotations

from typing import Literal

from precache.server.errors import APIError
from precache.server.protocol import MAX_N, ChatRequest, CompletionRequest
from precache.server.tool_parsers import ToolParser, get_parser
from precache.server.tools import ToolRequest, renders_tools, tool_messages, tool_request


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
