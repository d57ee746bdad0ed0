"""One access-log line per HTTP request, on by default (logger ``precache.server.access``, INFO):
method, path, status and seconds to the last byte; for a generation request also the model, its
prompt, cached and completion tokens and its TTFT. ``/health`` and ``/metrics`` polls are left out.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

#: the key of a generation request's record in the ASGI scope's ``state`` (``request.state.access``)
STATE_KEY = "access"
QUIET_PATHS = ("/health", "/metrics")


class AccessLog:
    """ASGI middleware over ``app``: logs each request once its response is sent (a stream: at its
    last chunk; a client that leaves: with status 499)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in QUIET_PATHS:
            return await self.app(scope, receive, send)
        start, status, logged = time.perf_counter(), 0, False

        async def sending(message):
            nonlocal status, logged
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and not logged:
                logged = True
                _log(scope, status, time.perf_counter() - start)

        try:
            await self.app(scope, receive, sending)
        finally:
            if not logged:
                _log(scope, status or 499, time.perf_counter() - start)


def _log(scope, status: int, seconds: float) -> None:
    line = f"{scope['method']} {scope['path']} {status} {seconds:.3f}s"
    group = scope.get("state", {}).get(STATE_KEY)
    if group is not None:
        line += " " + group.summary()
    logger.info(line)
