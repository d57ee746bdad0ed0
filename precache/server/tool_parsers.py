"""Tool-call formats (``precache serve --tool-call-parser``): each parser reads calls out of an
answer's text, writes the Lark grammar that forces a call in its format, and writes past calls
back into a message.

Parsers read with a JSON decoder from where a call starts (``json.JSONDecoder.raw_decode``), never
by splitting the text: a ``;`` or a ``</tool_call>`` inside an argument string stays in the
argument. A forced answer (``tool_choice`` required or a named function, generated under the
grammar) is taken as generated: its complete calls are kept even when ``max_tokens`` cut the last.

The grammar embeds one JSON schema per call (llguidance's ``%json``) with ``name`` and the
arguments; each function's ``$defs`` / ``definitions`` are lifted to the top of that schema
(:func:`call_schema`) so that ``{"$ref": "#/$defs/Unit"}`` (what pydantic writes for an Enum or
a nested model) still resolves.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()
_DEF_KEYS = ("$defs", "definitions")


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


# -- call schemas ----------------------------------------------------------------------------
def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _rewrite_refs(node: Any, renames: dict[tuple[str, str], str], root: str, used: list[bool]) -> Any:
    """``node`` with each local ``$ref`` pointed at its new place: ``#/$defs/X`` and
    ``#/definitions/X`` at ``#/$defs/<renames[(key, X)]>``, any other (``#``, ``#/properties/..``)
    under ``root`` (``used[0]`` set when one is)."""
    if isinstance(node, list):
        return [_rewrite_refs(item, renames, root, used) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rewrite_refs(v, renames, root, used) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        for key in _DEF_KEYS:
            name, sep, tail = ref.removeprefix(f"#/{key}/").partition("/")
            if ref.startswith(f"#/{key}/") and (key, _unescape(name)) in renames:
                out["$ref"] = f"#/$defs/{_escape(renames[(key, _unescape(name))])}{sep}{tail}"
                break
        else:
            out["$ref"], used[0] = root + ref[1:], True
    return out


def lift_definitions(functions: list[Function]) -> tuple[list[dict], dict]:
    """``(arguments schemas, $defs)``: each function's parameters without its ``$defs`` /
    ``definitions``, which go into one ``$defs`` for the top of the combined schema (a name
    another function already took becomes ``<function>.<name>``), every local ``$ref`` rewritten
    to match; a schema that refers to its own root (``#``) is itself put in ``$defs`` (as
    ``<function>.parameters``) and its arguments schema is a ``$ref`` to it."""
    lifted: dict[str, Any] = {}
    schemas = []
    for f in functions:
        params = f.parameters
        renames = {}
        for key in _DEF_KEYS:
            defs = params.get(key)
            for name in defs if isinstance(defs, dict) else ():
                new = name if name not in lifted and name not in renames.values() else f"{f.name}.{name}"
                renames[(key, name)] = new
        own = f"{f.name}.parameters"
        root, used = f"#/$defs/{_escape(own)}", [False]
        body = {k: v for k, v in params.items() if not (k in _DEF_KEYS and isinstance(v, dict))}
        body = _rewrite_refs(body, renames, root, used)
        for (key, name), new in renames.items():
            lifted[new] = _rewrite_refs(params[key][name], renames, root, used)
        if used[0]:
            lifted[own], body = body, {"$ref": root}
        schemas.append(body)
    return schemas, lifted


def call_schema(functions: list[Function], key: str) -> tuple[dict, dict]:
    """``(schema, $defs)``: the JSON schema of one call object ``{"name": <one of functions>, key:
    <its arguments>}`` and the definitions its references need at the root of the whole schema
    (:func:`lift_definitions`)."""
    arguments, defs = lift_definitions(functions)
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, key: args},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f, args in zip(functions, arguments, strict=True)
    ]
    return (options[0] if len(options) == 1 else {"anyOf": options}), defs


def _root_schema(schema: dict, defs: dict) -> str:
    """JSON text of a whole ``%json`` schema: ``defs`` at its top, free whitespace off (as
    ``JSON_LAYOUT`` in :mod:`precache.engine.structured`)."""
    return json.dumps(
        {**schema, **({"$defs": defs} if defs else {}), "x-guidance": {"whitespace_flexible": False}}
    )


# -- parsers -----------------------------------------------------------------------------------
def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _call(obj: Any, key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _decode_call(text: str, at: int, key: str) -> tuple[ToolCall | None, int]:
    """The call whose JSON object starts at ``at`` (None: no JSON object, or not a call) and the
    index just past it."""
    try:
        obj, end = _DECODER.raw_decode(text, at)
    except json.JSONDecodeError:
        return None, at
    return _call(obj, key), end


class ToolParser:
    """Reads calls out of an answer's text (``parse``) and writes the grammar that forces them
    (``grammar``) and a past call back into a message (``write``), in one format."""

    name = ""
    #: how the default tool prompt (:mod:`precache.server.tools`) tells the model to write a call
    instructions = ""

    def parse(self, text: str, forced: bool = False) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)``: the text outside the calls (None when empty) and the calls. An
        answer with a block that does not parse as a call is all content, as vLLM returns it;
        ``forced`` (the answer was generated under :meth:`grammar`): the calls before a cut one
        are kept and the cut one dropped (all content when none is complete)."""
        raise NotImplementedError

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) of one call, or of one or more with ``parallel``."""
        raise NotImplementedError

    def write(self, calls: list[dict]) -> str:
        """Earlier ``tool_calls`` of an assistant message as text in this format."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call."""

    name = "hermes"
    instructions = (
        'To call a function, answer with a JSON object holding its "name" and its "arguments" inside '
        "<tool_call></tool_call>, one block per call:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
    )
    opening, closing = "<tool_call>", "</tool_call>"

    def parse(self, text, forced=False):
        calls, outside, at = [], [], 0
        while (start := text.find(self.opening, at)) >= 0:
            call, end = _decode_call(text, _skip_space(text, start + len(self.opening)), "arguments")
            end = _skip_space(text, end)
            closed = text.startswith(self.closing, end)
            if call is None or not (closed or end == len(text)):  # not a call, or a cut one
                if forced and calls:
                    return None, calls
                return (text or None), []
            calls.append(call)
            outside.append(text[at:start])
            at = end + len(self.closing) if closed else end
        if not calls:
            return (text or None), []
        content = "".join([*outside, text[at:]]).strip()
        return (content or None), calls

    def grammar(self, functions, parallel):
        schema = _root_schema(*call_schema(functions, "arguments"))
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

    def parse(self, text, forced=False):
        body = text.removeprefix("<|python_tag|>")
        at = _skip_space(body, 0)
        if not body.startswith("{", at):
            return (text or None), []
        calls = []
        while True:
            call, end = _decode_call(body, at, "parameters")
            if call is None:
                return (None, calls) if forced and calls else ((text or None), [])
            calls.append(call)
            at = _skip_space(body, end)
            if at == len(body):
                return None, calls
            if body[at] != ";":
                return (None, calls) if forced else ((text or None), [])
            at = _skip_space(body, at + 1)

    def grammar(self, functions, parallel):
        schema = _root_schema(*call_schema(functions, "parameters"))
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

    def parse(self, text, forced=False):
        at = text.find(self.marker)
        if at < 0:
            return (text or None), []
        pos = _skip_space(text, at + len(self.marker))
        listed = text.startswith("[", pos)
        pos = _skip_space(text, pos + 1) if listed else pos
        calls = []
        while True:
            call, end = _decode_call(text, pos, "arguments")
            if call is None:
                return (None, calls) if forced and calls else ((text or None), [])
            calls.append(call)
            pos = _skip_space(text, end)
            if listed and text.startswith(",", pos):
                pos = _skip_space(text, pos + 1)
                continue
            whole = (text.startswith("]", pos) if listed else True) and (
                _skip_space(text, pos + listed) == len(text)
            )
            if whole:
                return (text[:at].strip() or None), calls
            return (None, calls) if forced else ((text or None), [])

    def grammar(self, functions, parallel):
        item, defs = call_schema(functions, "arguments")
        schema = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return f'start: "{self.marker}" body\nbody: %json {_root_schema(schema, defs)}\n'

    def write(self, calls):
        return self.marker + json.dumps([_as_object(c) for c in calls], ensure_ascii=False)


def _as_object(call: dict) -> dict:
    """An OpenAI ``tool_calls`` entry (checked by the request models) as ``{"name", "arguments":
    <object>}``."""
    fn = call["function"]
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # else written back as the client sent it
            args = json.loads(args)
    return {"name": fn["name"], "arguments": args}


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def get_parser(name: str) -> ToolParser:
    """Raises ValueError naming the known parsers."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(TOOL_PARSERS)})")
    return TOOL_PARSERS[name]()
