"""One replica of the cluster: a precache engine behind the same FastAPI app and server loop as
``precache serve`` (:func:`precache.server.app.create_app`), driven over Ray instead of a socket.

The ingress hands each HTTP request over as a :class:`ForwardedRequest`; :meth:`PrecacheReplica.handle`
runs the app on it as an ASGI call and streams the response back as :class:`ResponseStart` then
``bytes`` pieces, the start naming the replica in the ``x-precache-replica`` header. Ray polls
:meth:`PrecacheReplica.record_routing_stats`, which reports the block hashes of the trajectories the
replica's sessions hold (:mod:`precache.cluster.routing`), for the affinity router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from precache.cluster.routing import block_hashes
from precache.server.app import create_app
from precache.server.guard import KEY_SCOPE

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-precache-replica"


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress forwards it: ``path`` (``/v1/completions``), ``query`` (the raw
    query string), ``headers`` (lower-case names; never the API key), the raw ``body``; ``hashes``:
    the block hashes of the prompt's token ids (empty when it has none), which the affinity router
    reads; ``key``: the fingerprint of the API key the ingress authenticated (None: none), which
    makes the request's tenant on the replica as on one server; ``replica``: the replica that must
    serve it (the ingress's per-replica ``/metrics``; None: the router chooses)."""

    method: str
    path: str
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    hashes: tuple[int, ...] = field(default=(), repr=False)
    key: str | None = field(default=None, repr=False)
    replica: str | None = None


@dataclass(frozen=True)
class ResponseStart:
    """The status and headers of a response (sent before its body pieces)."""

    status: int
    headers: tuple[tuple[str, str], ...]


def trajectory_holdings(entries: list[tuple[list[int], int, str | None]], block_size: int) -> dict:
    """Routing stats of sessions given as ``(token ids, prompt length of the latest request,
    tenant)`` (each hashed under its tenant's salt, as the ingress hashes a request's prompt):
    ``{"blocks": every block hash, "anchors": the hash of each latest prompt's last full block,
    "sessions": how many}`` (lists of ints, so Ray ships them compactly)."""
    blocks: set[int] = set()
    anchors: set[int] = set()
    for token_ids, anchor, tenant in entries:
        hashes = block_hashes(token_ids, block_size, tenant)
        blocks.update(hashes)
        n = anchor // block_size
        if n:
            anchors.add(hashes[n - 1])
    return {"blocks": sorted(blocks), "anchors": sorted(anchors), "sessions": len(entries)}


class PrecacheReplica:
    """A Ray Serve deployment class: ``engine_factory()`` builds the engine in the replica's process
    (so the model loads where it runs); ``server_config`` is the single-process server's
    :class:`~precache.server.config.ServerConfig`; ``block_size`` the routing block (tokens)."""

    def __init__(self, engine_factory: Callable, server_config, block_size: int):
        from ray import serve  # the optional extra: this module's records load without it

        self.app = create_app(engine_factory(), server_config)
        self.loop = self.app.state.loop
        self.loop.start()  # what the app's lifespan does; a replica has no uvicorn to run it
        self.block_size = block_size
        self.name = serve.get_replica_context().replica_id.unique_id
        logger.info("replica %s ready", self.name)

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Run the API on ``request``: one :class:`ResponseStart`, then the body in pieces. Closing
        the stream early (the client left) tells the app the client disconnected."""
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        received = False

        async def receive() -> dict:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        task = asyncio.create_task(self.app(_scope(request), receive, sent.put))
        task.add_done_callback(lambda _: sent.put_nowait(None))
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"])
                    yield ResponseStart(message["status"], (*headers, (REPLICA_HEADER, self.name)))
                elif message["type"] == "http.response.body" and message.get("body"):
                    yield bytes(message["body"])
        finally:
            if not task.done():
                gone.set()  # the app cancels the request's job on a disconnect
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), 5.0)
                task.cancel()

    async def record_routing_stats(self) -> dict:
        """What this replica holds, for the router (Ray calls it every routing-stats period)."""

        def snapshot(pool) -> list[tuple[list[int], int, str | None]]:
            return [(list(e.session.token_ids), e.anchor, e.tenant) for e in pool.entries.values()]

        entries = await asyncio.wrap_future(self.loop.call(snapshot))
        stats = await asyncio.to_thread(trajectory_holdings, entries, self.block_size)
        active, pending = await asyncio.wrap_future(self.loop.call(lambda _: self.loop.load()))
        return {**stats, "active": active, "pending": pending}

    async def release_idle(self, request: ForwardedRequest) -> dict:
        """``bench soak``'s leak check, reached only through a Ray handle, routed to
        ``request.replica``: once nothing is in flight, drop every idle session and count the KV
        blocks (:meth:`~precache.server.loop.ServerLoop.release_idle`), with ``"replica"`` added."""
        counts = await asyncio.to_thread(self.loop.release_idle)
        return {"replica": self.name, **counts}

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()


def _scope(request: ForwardedRequest) -> dict:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query.encode(),
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    if request.key is not None:  # authenticated at the ingress: the replica's tenant is the key's
        scope[KEY_SCOPE] = request.key
    return scope
