"""Run the server: :class:`DrainingServer` (uvicorn with precache's drain and connection limits)
for ``precache serve``, and :class:`LiveServer`, the same in a background thread of this process
(tests, the serving benchmark)."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from precache.server.connections import ConnectionLimits, limited_protocol

#: after the drain time, how long the handlers get to send their 503s and error events before
#: uvicorn closes what is left
FLUSH_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn serving ``app`` (:func:`~precache.server.app.create_app`'s) that drains on the first
    SIGTERM / SIGINT (or :meth:`begin_drain`): it keeps listening, ``/health`` answers 503
    ``draining``, new generation requests get 503, and running ones get ``drain_timeout_s``
    seconds (None: as long as they take). When the time runs out, each open stream gets an error
    event and ``[DONE]`` and each waiting response a 503 (``ServerLoop.fail_all``); then the
    server stops. A second signal stops it at once (uvicorn's own behaviour).
    ``limits``: :class:`~precache.server.connections.ConnectionLimits` of every connection.
    """

    def __init__(
        self,
        app,
        host: str,
        port: int,
        drain_timeout_s: float | None = 30.0,
        limits: ConnectionLimits | None = None,
        log_level: str = "warning",
        banner: str | None = None,
    ):
        metrics = app.state.metrics
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            http=limited_protocol(limits or ConnectionLimits(), metrics),
            timeout_graceful_shutdown=FLUSH_S,
        )
        super().__init__(config)
        self.app, self.drain_timeout_s, self.banner = app, drain_timeout_s, banner
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.banner and not self.should_exit:
            import logging

            logging.getLogger("precache.server").info(self.banner)

    def handle_exit(self, sig, frame) -> None:
        if self.draining or self.should_exit or self._loop is None:
            super().handle_exit(sig, frame)
        else:
            self.begin_drain()

    def begin_drain(self) -> None:
        """Start draining (any thread); the server stops when it is over."""
        if self.draining:
            return
        self.draining = True
        self.app.state.loop.draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        scheduler = self.app.state.loop
        deadline = None if self.drain_timeout_s is None else time.monotonic() + self.drain_timeout_s
        while self.server_state.tasks and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        if self.server_state.tasks:
            scheduler.fail_all(
                503,
                f"the server is shutting down: the drain time ({self.drain_timeout_s:g} s) ran out",
                "unavailable",
            )
            flush = time.monotonic() + FLUSH_S
            while self.server_state.tasks and time.monotonic() < flush:
                await asyncio.sleep(0.02)
        self.should_exit = True


class LiveServer:
    """``with LiveServer(app) as server: server.url`` serves ``app`` with :class:`DrainingServer`
    on ``host`` (loopback by default) and a free port (``port=0``), and stops it on exit. On
    :meth:`stop`, the server drains: running requests get ``shutdown_timeout_s`` seconds to finish
    (None: as long as they take), then they end with an error (``precache serve --shutdown-timeout``).

    Raises:
        RuntimeError: the server did not start within ``start_timeout_s`` seconds.
    """

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout_s: float = 30.0,
        shutdown_timeout_s: float | None = None,
        limits: ConnectionLimits | None = None,
    ):
        self.app = app
        self.server = DrainingServer(app, host, port, drain_timeout_s=shutdown_timeout_s, limits=limits)
        self.host, self.port, self.timeout_s = host, port, start_timeout_s
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API, e.g. ``http://127.0.0.1:8000/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> LiveServer:
        self._thread = threading.Thread(target=self.server.run, name="precache-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def begin_drain(self) -> None:
        """What SIGTERM does to ``precache serve``: drain, then stop (returns at once)."""
        self.server.begin_drain()

    def stop(self) -> None:
        """Drain (at most the shutdown timeout plus a flush), then stop; waits for the thread."""
        if self.server.started:
            self.server.begin_drain()
        else:
            self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=60)

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
