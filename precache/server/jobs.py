"""An HTTP generation request as the server loop sees it (the API's record of a request), and
what the loop sends back to its handler.

The server loop (:mod:`precache.server.loop`) calls :meth:`Job.emit`; the handler awaits
:meth:`Job.events` on the event loop. The hand-over is ``loop.call_soon_threadsafe`` into an
``asyncio.Queue``. Events are the engine's outputs as they are: each sampled token of choice
``index`` (:class:`~precache.engine.outputs.StreamChunk`), each choice's finished
:class:`~precache.engine.outputs.Turn`, or an :class:`ErrorEvent` that ends the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from precache.config import SamplingParams
from precache.engine.outputs import StreamChunk, Turn

if TYPE_CHECKING:
    from precache.engine.request import Request
    from precache.server.sessions import PooledSession

_ids = itertools.count()


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed after it was accepted (HTTP ``status``)."""

    status: int
    message: str
    code: str | None = None


Event = StreamChunk | Turn | ErrorEvent


def finish_reason(turn: Turn) -> str:
    """The OpenAI ``finish_reason`` of a turn: ``"length"``, else ``"stop"`` (EOS, a stop string or
    a stop token id)."""
    return "length" if turn.stop_reason == "length" else "stop"


@dataclass
class Job:
    """One request: ``agent`` (adapter name, None: base model) continues ``prompt_ids`` with
    ``params`` (``params.n`` choices, sampled alongside by the engine).

    ``model`` is the name the client asked for (metrics label); ``arrival`` a ``perf_counter``
    time in seconds; ``session_id`` pins a trajectory; ``tenant``: whose cache it may reuse
    (:mod:`precache.server.tenants`; None: the default tenant); ``stream``: tokens go to the client
    as they come. The loop fills ``entry`` (the claimed session), ``request`` (the engine's
    request), ``first_token_s`` and ``reported`` (choices whose turn went out).
    """

    agent: str | None
    prompt_ids: list[int]
    params: SamplingParams
    model: str = ""
    session_id: str | None = None
    tenant: str | None = None
    stream: bool = False
    dropped: bool = False  # cancelled or failed (set on the server loop): nothing more goes out
    entry: PooledSession | None = field(default=None, repr=False)
    request: Request | None = field(default=None, repr=False)
    first_token_s: float | None = None
    reported: set[int] = field(default_factory=set)
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.perf_counter)
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    queue: asyncio.Queue | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        """Choices asked for."""
        return self.params.n

    def bind(self, loop: asyncio.AbstractEventLoop) -> Job:
        """Deliver events to ``loop`` (call on that loop before submitting)."""
        self.loop, self.queue = loop, asyncio.Queue()
        return self

    def emit(self, event: Event) -> None:
        """Send ``event`` to the handler (any thread); dropped when the loop is gone."""
        if self.loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self) -> AsyncIterator[Event]:
        """Events until (and with) the last choice's :class:`Turn` or an :class:`ErrorEvent`."""
        left = self.n
        while left:
            event = await self.queue.get()
            yield event
            if isinstance(event, ErrorEvent):
                return
            left -= isinstance(event, Turn)
