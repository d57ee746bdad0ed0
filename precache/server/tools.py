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

Parsers (:data:`TOOL_PARSERS`, ``precache serve --tool-call-parser``): ``hermes`` (default),
``llama3_json`` (a JSON object ``{"name", "parameters"}``, optionally after ``<|python_tag|>``) and
``mistral`` (``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``).
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from precache.config import StructuredOutput
from precache.server.errors import APIError, quote

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query. The functions are listed as JSON \
inside <tools></tools>:
<tools>
{tools}
</tools>

{instructions}"""


@dataclass(frozen=True)
class Function:
    """One function the model may call: ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolRequest:
    """The request's tools and what it asks of them: ``choice`` is ``auto``, ``required`` or
    ``function`` (then ``function`` names it); ``parallel``: several calls in one answer."""

    functions: tuple[Function, ...]
    choice: str
    function: str | None = None
    parallel: bool = True


def tool_request(tools: list | None, tool_choice: Any, parallel: bool | None) -> ToolRequest | None:
    """The request's :class:`ToolRequest`, or None when no tool may be called (no tools, or
    ``tool_choice: "none"``).

    Raises:
        APIError: 400 naming ``tools`` or ``tool_choice``: a malformed tool, a duplicate name, a
            choice other than none / auto / required / a named function, or a function not listed.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice: needs tools", "tool_choice", "invalid_value")
        return None
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(
                400,
                f"tools.{i}: must be {{'type': 'function', 'function': {{...}}}}",
                "tools",
                "invalid_value",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise APIError(
                400,
                f"tools.{i}.function.name: 1-64 letters, digits, _ . -, got {quote(name)}",
                "tools",
                "invalid_value",
            )
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise APIError(
                400, f"tools.{i}.function.parameters: must be a JSON schema object", "tools", "invalid_value"
            )
        functions.append(Function(name, str(fn.get("description") or ""), params))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", "tools", "invalid_value")
    parallel = True if parallel is None else bool(parallel)
    if tool_choice in (None, "auto"):
        return ToolRequest(tuple(functions), "auto", None, parallel)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolRequest(tuple(functions), "required", None, parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise APIError(
                400, f"tool_choice: function {quote(name)} is not in tools", "tool_choice", "invalid_value"
            )
        return ToolRequest(tuple(functions), "function", name, False)
    raise APIError(
        400,
        f"tool_choice: none, auto, required or {{'type': 'function', 'function': {{'name': ...}}}}, got "
        f"{quote(tool_choice)}",
        "tool_choice",
        "invalid_value",
    )


# -- parsers ----------------------------------------------------------------------------------
class ToolParser:
    """Reads calls out of an answer's text (``parse``) and writes the grammar that forces them
    (``grammar``) and a past call back into a message (``write``), in one format."""

    name = ""
    #: how :data:`DEFAULT_TOOL_PROMPT` tells the model to write a call in this format
    instructions = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)``: the text outside the calls (None when empty) and the calls; an
        answer whose call does not parse as JSON is content, as vLLM returns it."""
        raise NotImplementedError

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) of one call, or of one or more with ``parallel``."""
        raise NotImplementedError

    def write(self, calls: list[dict]) -> str:
        """Earlier ``tool_calls`` of an assistant message as text in this format."""
        raise NotImplementedError


def _call_schema(functions: list[Function], key: str) -> dict:
    """JSON schema of one call object: ``{"name": <one of functions>, key: <its parameters>}``."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, key: f.parameters},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}  # as JSON_LAYOUT in structured.py


def _call(obj: Any, key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call."""

    name = "hermes"
    instructions = (
        'To call a function, answer with a JSON object holding its "name" and its "arguments" inside '
        "<tool_call></tool_call>, one block per call:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
    )
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text):
        calls, spans = [], []
        for m in self._block.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return (text or None), []  # a block that is not a call: all of it is content
            calls.append(call)
            spans.append(m.span())
        if not calls:
            return (text or None), []
        starts, ends = [0, *(e for _, e in spans)], [*(s for s, _ in spans), len(text)]
        content = "".join(text[a:b] for a, b in zip(starts, ends, strict=True))
        return (content.strip() or None), calls

    def grammar(self, functions, parallel):
        schema = json.dumps(_call_schema(functions, "arguments"))
        calls = "call (ws call)*" if parallel else "call"
        return (
            f"start: {calls}\n"
            f'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {schema}\n"
            f'ws: "\\n"\n'
        )

    def write(self, calls):
        return "\n".join(
            f"<tool_call>\n{json.dumps(_as_object(c), ensure_ascii=False)}\n</tool_call>" for c in calls
        )


class Llama3JsonParser(ToolParser):
    """Llama 3.x: the answer is one JSON object ``{"name": ..., "parameters": {...}}`` (several
    separated by ``;``), optionally after ``<|python_tag|>``."""

    name = "llama3_json"
    instructions = (
        "To call a function, answer with only a JSON object of the form "
        '{"name": <function-name>, "parameters": <arguments-json-object>}.'
    )

    def parse(self, text):
        body = text.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return (text or None), []
        calls = []
        for part in body.split(";"):
            try:
                call = _call(json.loads(part), "parameters")
            except json.JSONDecodeError:
                return (text or None), []
            if call is None:
                return (text or None), []
            calls.append(call)
        return None, calls

    def grammar(self, functions, parallel):
        schema = json.dumps(_call_schema(functions, "parameters"))
        calls = 'call ("; " call)*' if parallel else "call"
        return f"start: {calls}\ncall: %json {schema}\n"

    def write(self, calls):
        return "; ".join(
            json.dumps({"name": o["name"], "parameters": o["arguments"]}, ensure_ascii=False)
            for o in map(_as_object, calls)
        )


class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    instructions = (
        "To call functions, answer with [TOOL_CALLS] followed by a JSON list of "
        '{"name": <function-name>, "arguments": <arguments-json-object>} objects.'
    )

    def parse(self, text):
        at = text.find(self.marker)
        if at < 0:
            return (text or None), []
        try:
            items = json.loads(text[at + len(self.marker) :].strip())
        except json.JSONDecodeError:
            return (text or None), []
        items = items if isinstance(items, list) else [items]
        calls = [_call(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return (text or None), []
        return (text[:at].strip() or None), calls

    def grammar(self, functions, parallel):
        item = _call_schema(functions, "arguments")
        schema = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return f'start: "{self.marker}" body\nbody: %json {json.dumps(schema)}\n'

    def write(self, calls):
        return self.marker + json.dumps([_as_object(c) for c in calls], ensure_ascii=False)


def _as_object(call: dict) -> dict:
    """An OpenAI ``tool_calls`` entry as ``{"name", "arguments": <object>}``."""
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # else written back as the client sent it
            args = json.loads(args)
    return {"name": fn.get("name", ""), "arguments": args}


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def get_parser(name: str) -> ToolParser:
    """Raises ValueError naming the known parsers."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(TOOL_PARSERS)})")
    return TOOL_PARSERS[name]()


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
