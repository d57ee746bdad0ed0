"""An HTTP generation request as the server loop sees it, and the events it sends back to the handler.

The server loop (:mod:`precache.server.scheduler`) calls :meth:`Job.emit`; the handler awaits
:meth:`Job.events` on the event loop. The hand-over is ``loop.call_soon_threadsafe`` into an
``asyncio.Queue``. Events: each sampled token of choice ``index`` (:class:`Delta`), each choice's
finished :class:`~precache.engine.request.Turn` (:class:`ChoiceEnd`), or an :class:`ErrorEvent`
that ends the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from precache.config import SamplingParams
from precache.engine.request import StreamChunk, Turn

_ids = itertools.count()


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed after it was accepted (HTTP ``status``)."""

    status: int
    message: str
    code: str | None = None


@dataclass(frozen=True)
class Delta:
    """A token of choice ``index`` and the text it makes safe to send."""

    index: int
    chunk: StreamChunk


@dataclass(frozen=True)
class ChoiceEnd:
    """Choice ``index`` is over: its turn."""

    index: int
    turn: Turn


Event = Delta | ChoiceEnd | ErrorEvent


def finish_reason(turn: Turn) -> str:
    """The OpenAI ``finish_reason`` of a turn: ``"length"``, else ``"stop"`` (EOS, a stop string or
    a stop token id)."""
    return "length" if turn.stop_reason == "length" else "stop"


@dataclass
class Job:
    """One request: ``agent`` (adapter name, None: base model) continues ``prompt_ids``.

    ``model`` is the name the client asked for (metrics label); ``arrival`` a ``perf_counter``
    time in seconds; ``session_id`` pins a trajectory; ``n`` choices (choice 0 runs on the
    conversation's session, the others on forks of its prompt); ``tenant``: whose cache it may reuse
    (:mod:`precache.server.tenants`; None: the default tenant); ``stream``: tokens go to the client
    as they come (a job that streamed nothing yet may be started again).
    """

    agent: str | None
    prompt_ids: list[int]
    params: SamplingParams
    model: str = ""
    session_id: str | None = None
    n: int = 1
    tenant: str | None = None
    stream: bool = False
    dropped: bool = False  # cancelled or failed (set on the server loop): no more choices start
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.perf_counter)
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    queue: asyncio.Queue | None = field(default=None, repr=False)

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
        """Events until (and with) the last choice's :class:`ChoiceEnd` or an :class:`ErrorEvent`."""
        left = self.n
        while left:
            event = await self.queue.get()
            yield event
            if isinstance(event, ErrorEvent):
                return
            left -= isinstance(event, ChoiceEnd)
