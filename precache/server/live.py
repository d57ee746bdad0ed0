"""Run the server in a background thread of this process (tests, the serving benchmark)."""

from __future__ import annotations

import threading
import time

import uvicorn


class LiveServer:
    """``with LiveServer(app) as server: server.url`` serves ``app`` with uvicorn on ``host``
    (loopback by default) and a free port (``port=0``), and stops it on exit. On :meth:`stop`,
    running requests get ``shutdown_timeout_s`` seconds to finish (None: as long as they take), then
    they are cancelled (``precache serve --shutdown-timeout``).

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
    ):
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=shutdown_timeout_s,
        )
        self.app, self.server = app, uvicorn.Server(config)
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

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
