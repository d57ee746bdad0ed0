"""Errors in the OpenAI format: ``{"error": {"message", "type", "param", "code"}}``, the 400s of
the engine's typed errors (:func:`engine_refusal`), and the FastAPI handlers that turn every
failure into one (a bad request never stops the server)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from precache.errors import ContextLengthError, EmptyRequestError, PrecacheError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` (4xx: the client's fault, 5xx: ours), a
    message the user can act on, the request field at fault (``param``) and a short ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def refuse(param: str, message: str, code: str = "unsupported_parameter") -> APIError:
    """The 400 refusing request field ``param``: ``"<param>: <message>"``, ``param`` and ``code``."""
    return APIError(400, f"{param}: {message}", param, code)


#: the OpenAI ``code`` of the engine's typed errors a request body can cause (others: invalid_value)
ENGINE_CODES: tuple[tuple[type[PrecacheError], str], ...] = (
    (EmptyRequestError, "empty_prompt"),
    (ContextLengthError, "context_length_exceeded"),
)


def engine_refusal(exc: PrecacheError) -> APIError:
    """The 400 of a request the engine's validation (:mod:`precache.engine.validation`) refused:
    its message, ``param`` the field the error names, ``code`` by its type (:data:`ENGINE_CODES`)."""
    code = next((c for kind, c in ENGINE_CODES if isinstance(exc, kind)), "invalid_value")
    return APIError(400, str(exc), exc.param, code)


@contextmanager
def engine_checks() -> Iterator[None]:
    """Run the engine's checks of a request: a typed error they raise becomes its 400
    (:func:`engine_refusal`)."""
    try:
        yield
    except PrecacheError as exc:
        raise engine_refusal(exc) from None


#: the most characters of a client's value an error message quotes
MAX_QUOTE_CHARS = 64
#: the longest error message (a message that quotes values is cut there)
MAX_MESSAGE_CHARS = 1024
#: the code of an error raised without one, by status
DEFAULT_CODES = {400: "invalid_request", 404: "not_found", 413: "request_too_large", 503: "unavailable"}


def quote(value: object) -> str:
    """``repr(value)``, cut to :data:`MAX_QUOTE_CHARS` characters with the length said: an error
    message never echoes a client's long value back whole."""
    text = repr(value)
    if len(text) <= MAX_QUOTE_CHARS:
        return text
    return f"{text[:MAX_QUOTE_CHARS]}... ({len(text)} characters)"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object for HTTP ``status`` (a lone surrogate quoted from the request becomes
    ``?``: the body must encode as UTF-8); the message is cut at :data:`MAX_MESSAGE_CHARS`, and an
    error raised without a code gets its status's (:data:`DEFAULT_CODES`, else ``internal_error``
    for 5xx and ``invalid_request`` for 4xx)."""
    message = message.encode("utf-8", "replace").decode("utf-8")
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    kind = "invalid_request_error" if status < 500 else "server_error"
    if code is None:
        code = DEFAULT_CODES.get(status, "internal_error" if status >= 500 else "invalid_request")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status)


#: the ``loc`` entries of a pydantic error that name a member of a union, not a field: the member's
#: type (``str``, ``list[int]``, ``literal['none','auto']``, ``function-after[...]``) or model class
_PRIMITIVE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "bytes"})


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _PRIMITIVE_TAGS or part[:1].isupper())


def field_path(loc: tuple | list) -> str:
    """The path of a pydantic error's ``loc`` as a client spells it: ``messages[2].tool_calls[0]
    .function`` (the leading ``body`` and union members dropped; "" for the whole body)."""
    path = ""
    for i, part in enumerate(loc):
        if (i == 0 and part == "body") or _is_union_tag(part):
            continue
        path += f"[{part}]" if isinstance(part, int) else f"{'.' if path else ''}{part}"
    return path


def _code(kind: str) -> str:
    if kind == "missing":
        return "missing_required_parameter"
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind.endswith(("_type", "_parsing")):
        return "invalid_type"
    return "invalid_value"


def validation_error(errors: list[dict]) -> APIError:
    """The 400 of a body that does not fit the request models (pydantic's ``errors()``): of the
    errors (one per union member tried), the one whose path goes deepest (the member the client
    meant), with ``param`` = its :func:`field_path` and a ``code``: ``missing_required_parameter``,
    ``unknown_parameter``, ``invalid_type`` or ``invalid_value`` (``invalid_json``: not JSON)."""
    if not errors:
        return APIError(400, "invalid request", None, "invalid_value")
    first = max(errors, key=lambda e: len([p for p in e.get("loc", ()) if not _is_union_tag(p)]))
    kind = first.get("type", "")
    if kind == "json_invalid":
        reason = first.get("ctx", {}).get("error", "cannot parse")
        return APIError(400, f"malformed JSON body: {reason}", None, "invalid_json")
    raw = first.get("input")
    if tuple(first.get("loc", ())) == ("body",) and isinstance(raw, bytes | str):  # no JSON content-type
        try:
            json.loads(raw)
        except ValueError as exc:
            return APIError(400, f"malformed JSON body: {exc}", None, "invalid_json")
        return APIError(400, "send the body as JSON (content-type: application/json)", None, "invalid_json")
    path = field_path(first.get("loc", ()))
    message = first.get("msg", "invalid value")
    if not path and kind == "missing":
        message = "send a JSON object as the body"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "Input should be a JSON object"
    return APIError(400, f"{path}: {message}" if path else message, path or None, _code(kind))


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception to an OpenAI error response: :class:`APIError` with its status, body
    validation (malformed JSON, wrong types) as 400, unknown routes as 404, the rest as 500."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.exception("unhandled error in a request")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
