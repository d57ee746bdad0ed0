"""Tool calling as vLLM serves it: the request's ``tools`` and ``tool_choice``, the prompt that shows
the tools to the model, the constraint that guarantees a call when one is required, and the
parsers that read calls back out of the answer.

The prompt: a chat template that renders tools (its source names ``tools``) gets them as
``apply_chat_template(tools=...)``; any other template gets :data:`DEFAULT_TOOL_PROMPT` (Hermes
style: the functions as JSON inside ``<tools>``, calls as ``<tool_call>{json}</tool_call>``)
appended to the system message, and earlier assistant ``tool_calls`` and ``tool`` results are
written into the messages' text in the same format. ``tool_choice: "none"`` leaves the tools out
of the prompt (vLLM's default) and never parses calls.

``required`` and a named function are guaranteed by constrained decoding
(:mod:`precache.engine.structured`): a Lark grammar whose calls embed each function's JSON schema
(llguidance's ``%json``), in the format of the request's parser. ``auto`` samples freely and
parses what comes out.

Parsers (:data:`~precache.server.tool_parsers.TOOL_PARSERS`, ``precache serve
--tool-call-parser``): ``hermes`` (default), ``llama3_json`` (a JSON object ``{"name",
"parameters"}``, optionally after ``<|python_tag|>``) and ``mistral`` (``[TOOL_CALLS]`` then a JSON
list of ``{"name", "arguments"}``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from precache.config import StructuredOutput
from precache.engine.structured import validate_structured_output
from precache.errors import StructuredOutputError
from precache.server.errors import APIError, quote
from precache.server.shapes import Tool, ToolChoice
from precache.server.tool_parsers import Function, ToolParser

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query. The functions are listed as JSON \
inside <tools></tools>:
<tools>
{tools}
</tools>

{instructions}"""


@dataclass(frozen=True)
class ToolRequest:
    """The request's tools and what it asks of them: ``choice`` is ``auto``, ``required`` or
    ``function`` (then ``function`` names it); ``parallel``: several calls in one answer."""

    functions: tuple[Function, ...]
    choice: str
    function: str | None = None
    parallel: bool = True


def tool_request(
    tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel: bool | None
) -> ToolRequest | None:
    """The request's :class:`ToolRequest` from its checked ``tools`` and ``tool_choice`` (the
    request models), or None when no tool may be called (no tools, or ``tool_choice: "none"``).
    Every function's parameters schema is compiled here, before anything runs.

    Raises:
        APIError: 400 naming the field (``tools[1].function.parameters``): a schema that does not
            compile, a duplicate name, a choice with no tools, or a named function not listed.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice: needs tools", "tool_choice", "invalid_value")
        return None
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.function
        params = fn.parameters or {"type": "object", "properties": {}}
        field = f"tools[{i}].function.parameters"
        try:
            validate_structured_output(StructuredOutput.json_schema(params))
        except StructuredOutputError as exc:
            raise APIError(400, f"{field}: {exc}", field, "invalid_schema") from None
        if fn.name in (f.name for f in functions):
            field = f"tools[{i}].function.name"
            raise APIError(400, f"{field}: {quote(fn.name)} is listed twice", field, "invalid_value")
        functions.append(Function(fn.name, fn.description or "", params))
    parallel = True if parallel is None else bool(parallel)
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto", "required"):
        return ToolRequest(tuple(functions), tool_choice or "auto", None, parallel)
    name = tool_choice.function.name
    if name not in (f.name for f in functions):
        field = "tool_choice.function.name"
        raise APIError(400, f"{field}: function {quote(name)} is not in tools", field, "invalid_value")
    return ToolRequest(tuple(functions), "function", name, False)


def tool_constraint(tools: ToolRequest, parser: ToolParser) -> StructuredOutput | None:
    """The constraint that makes the answer a call (``required``) or a call of the named function;
    None for ``auto``."""
    if tools.choice == "auto":
        return None
    functions = [f for f in tools.functions if tools.function in (None, f.name)]
    return StructuredOutput.grammar(parser.grammar(functions, tools.parallel))


# -- the prompt ---------------------------------------------------------------------------------
def renders_tools(tokenizer) -> bool:
    """The tokenizer's chat template takes a ``tools`` argument."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template


def tool_messages(
    messages: list[dict], tools: ToolRequest | None, parser: ToolParser, native: bool
) -> tuple[list[dict], dict]:
    """``(messages, template options)`` for a template that renders tools (``native``: the tools as
    ``tools=``, messages as sent) or not (:data:`DEFAULT_TOOL_PROMPT` in the system message, past
    calls and results as text). ``tools`` None: past calls and results are still written as text
    for a template that cannot render them."""
    if native:
        return messages, ({"tools": [f.openai() for f in tools.functions]} if tools else {})
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            text = parser.write(m.pop("tool_calls"))
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
        elif m.get("role") == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
        out.append(m)
    if tools is not None:
        listing = "\n".join(json.dumps(f.openai(), ensure_ascii=False) for f in tools.functions)
        prompt = DEFAULT_TOOL_PROMPT.format(tools=listing, instructions=parser.instructions)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content', '')}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}
