"""The ASGI layer in front of the routes: API-key authentication (401), the request-body limit (413,
checked on ``Content-Length`` and on the bytes actually received, before any parsing), and the
error counter of every response with a 4xx/5xx status (``precache_errors_total{status,code}``, 500s
from unhandled exceptions included).

It runs before FastAPI reads the body, so an oversized or unauthenticated request costs no parsing.
"""

from __future__ import annotations

import json
import logging

from precache.server.errors import error_body
from precache.server.metrics import ServerMetrics
from precache.server.tenants import Tenants

logger = logging.getLogger(__name__)

KEY_SCOPE = "precache.key"  # the authenticated key's fingerprint, in the ASGI scope
OPEN_PATHS = ("/health", "/metrics")  # as vLLM: liveness and metrics need no key


class Admission:
    """The checks made before a request's body is read: its API key (``tenants``) and its declared
    size (``max_body_bytes``, bytes). Shared by :class:`Guard` and the cluster's ingress, so a
    cluster refuses exactly what one server refuses."""

    def __init__(self, tenants: Tenants, max_body_bytes: int):
        self.tenants, self.max_body_bytes = tenants, max_body_bytes

    def check(self, path: str, headers: dict[str, str]) -> tuple[str | None, tuple[int, dict] | None]:
        """``(key fingerprint or None, refusal)`` for a request to ``path`` with lower-case
        ``headers``; the refusal is ``(status, error body)``: 401 for a missing or wrong key (where
        keys are required; ``/health`` and ``/metrics`` are open), 413 for a ``Content-Length``
        over the limit or not a number."""
        key = None
        if self.tenants.required and path not in OPEN_PATHS:
            key = self.tenants.authenticate(headers.get("authorization"))
            if key is None:
                message = "invalid or missing API key: send 'Authorization: Bearer <key>'"
                return None, (401, error_body(401, message, None, "invalid_api_key"))
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return key, (413, self.too_large(length))
        return key, None

    def too_large(self, length: str) -> dict:
        """The 413 error body for a body of ``length`` bytes (a number or a phrase)."""
        message = f"the request body ({length} bytes) exceeds the limit of {self.max_body_bytes} bytes"
        return error_body(413, message + " (--max-request-bytes)", None, "request_too_large")


class Guard:
    """ASGI middleware over ``app`` (see the module docstring). ``max_body_bytes``: the largest
    request body accepted, in bytes."""

    def __init__(self, app, tenants: Tenants, max_body_bytes: int, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics
        self.admission = Admission(tenants, max_body_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = self._counting(send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key, refusal = self.admission.check(scope["path"], headers)
        if refusal is not None:
            return await _reply(send, *refusal)
        if key is not None:
            scope[KEY_SCOPE] = key
        limit = self.admission.max_body_bytes
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _reply(send, 413, self.admission.too_large(f"more than {limit}"))
            body.append(chunk)
            more = message.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        try:
            return await self.app(scope, replayed, send)
        except Exception as exc:  # answered here: re-raised, it would reset the keep-alive connection
            logger.exception("unhandled error in a request")
            if send.started:
                self.metrics.error(500, "internal_error")
                return None
            body = error_body(500, f"internal error: {type(exc).__name__}", None, "internal_error")
            return await _reply(send, 500, body)

    def _counting(self, send):
        status: dict = {}

        async def counted(message):
            if message["type"] == "http.response.start":
                counted.started = True
                status["code"] = message["status"]
                status["json"] = any(
                    k.lower() == b"content-type" and v.startswith(b"application/json")
                    for k, v in message.get("headers", [])
                )
            elif message["type"] == "http.response.body" and status.get("code", 200) >= 400:
                code = _error_code(message.get("body", b"")) if status["json"] else None
                self.metrics.error(status.pop("code"), code or "none")
            await send(message)

        counted.started = False
        return counted


def _error_code(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


async def _reply(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
