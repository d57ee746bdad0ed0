"""A request's prompt as token ids: ``/v1/completions`` text or ids, ``/v1/chat/completions``
messages rendered by the chat template with vLLM's template options, and what ``echo`` repeats."""

from __future__ import annotations

from precache.server.errors import APIError
from precache.server.protocol import ChatRequest, CompletionRequest


def completion_prompt(req: CompletionRequest, codec, vocab_size: int) -> list[int]:
    """Token ids of the request's single prompt; text is tokenised with the tokenizer's special
    tokens (a BOS) unless ``add_special_tokens`` is false (vLLM's default: true).

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
                raise APIError(400, "only text content parts are supported", f"messages.{i}.content")
            content = "".join(part.text or "" for part in content)
        message["content"] = content
        out.append(message)
    return out


def chat_prompt(req: ChatRequest, codec) -> list[int]:
    """Token ids of the conversation rendered by the model's chat template with the request's
    ``add_generation_prompt``, ``continue_final_message``, ``documents`` and
    ``chat_template_kwargs`` (vLLM's options), tokenised with special tokens only when
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
    return codec.chat(chat_messages(req), options, add_special_tokens=req.add_special_tokens)


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
