"""Errors in the OpenAI format: ``{"error": {"message", "type", "param", "code"}}``, and the
FastAPI handlers that turn every failure into one (a bad request never stops the server)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` (4xx: the client's fault, 5xx: ours), a
    message the user can act on, the request field at fault (``param``) and a short ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return (
            f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}",
            None,
            "invalid_json",
        )
    raw = first.get("input")
    if first.get("loc") == ("body",) and isinstance(raw, bytes | str):  # no JSON content-type
        try:
            json.loads(raw)
        except ValueError as exc:
            return f"malformed JSON body: {exc}", None, "invalid_json"
        return "send the body as JSON (content-type: application/json)", None, "invalid_json"
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = (
        loc[0] if loc else None
    )  # the request field (the path below it, e.g. a union member, is in the message)
    where = f"{'.'.join(loc)}: " if loc else ""
    return f"{where}{first.get('msg', 'invalid request')}", param, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception to an OpenAI error response: :class:`APIError` with its status, body
    validation (malformed JSON, wrong types) as 400, unknown routes as 404, the rest as 500."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        message, param, code = _validation_message(exc)
        return JSONResponse(error_body(400, message, param, code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.exception("unhandled error in a request")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
