"""Limits on every HTTP connection, against slow and idle clients (slowloris): a cap on open
connections, a time limit for a request's headers and one for its body. uvicorn bounds neither
(its keep-alive timeout ends once any byte arrives), so they live in a subclass of its h11
protocol, which :class:`~precache.server.live.DrainingServer` serves with. Each refusal is counted
in ``precache_refused_total`` by reason (``max_connections``, ``header_timeout``,
``body_timeout``)."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

#: the whole answer to a connection refused before its request could be read
_RAW = (
    "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: {n}\r\n\r\n{text}"
)


def _raw(status: str, text: str) -> bytes:
    return _RAW.format(status=status, n=len(text), text=text).encode()


@dataclass(frozen=True)
class ConnectionLimits:
    """``max_connections``: open connections at once (more: 503 and closed at once);
    ``header_timeout_s``: seconds from a connection's first byte (or its previous response) to a
    request's complete headers; ``body_timeout_s``: seconds from the headers to the body's last
    byte. Past either, 408 and the connection closes (a running handler sees a disconnect).
    ``send_buffer_bytes``: the kernel's send buffer of each connection (``SO_SNDBUF``; Linux
    doubles it). Left to the kernel, loopback grows it to 4 MiB, so a client that stops reading
    would absorb megabytes before the server's stream backpressure
    (``ServerConfig.stream_buffer_events``) could see it.

    Raises:
        ValueError: a limit below 1 (connections) or not positive (seconds).
    """

    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    send_buffer_bytes: int = 64 * 1024

    def __post_init__(self):
        if (
            self.max_connections < 1
            or self.header_timeout_s <= 0
            or self.body_timeout_s <= 0
            or self.send_buffer_bytes < 4096
        ):
            raise ValueError(f"invalid connection limits: {self}")


def limited_protocol(limits: ConnectionLimits, metrics) -> type:
    """uvicorn's h11 protocol class with ``limits``, counting refusals in ``metrics``
    (:class:`~precache.server.metrics.ServerMetrics`)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class LimitedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport) -> None:
            if len(self.connections) >= limits.max_connections:
                self._refused, self.transport = True, transport
                metrics.refused.labels("max_connections").inc()
                transport.write(_raw("503 Service Unavailable", "too many open connections\n"))
                transport.close()
                return
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
            self._arm("header", limits.header_timeout_s)

        def connection_lost(self, exc) -> None:
            self._disarm()
            if not self._refused:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not None and self.cycle is not cycle:  # a request's headers are in
                if self.cycle.more_body:
                    self._arm("body", limits.body_timeout_s)
                else:
                    self._disarm()
            elif self.cycle is not None and not self.cycle.more_body and self._kind == "body":
                self._disarm()  # the whole request is in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # keep-alive: the next request's headers in time too
                self._arm("header", limits.header_timeout_s)

        _kind: str | None = None

        def _arm(self, kind: str, seconds: float) -> None:
            self._disarm()
            self._kind, self._timer = kind, self.loop.call_later(seconds, self._expire, kind)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._kind = None, None

        def _expire(self, kind: str) -> None:
            self._timer, self._kind = None, None
            if self.transport.is_closing():
                return
            metrics.refused.labels(f"{kind}_timeout").inc()
            if self.cycle is None or not self.cycle.response_started:
                seconds = limits.header_timeout_s if kind == "header" else limits.body_timeout_s
                self.transport.write(
                    _raw("408 Request Timeout", f"the request's {kind} took over {seconds:g} s\n")
                )
            self.transport.close()

    return LimitedH11Protocol
