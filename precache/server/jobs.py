"""A generation request as the scheduler sees it, and the events it sends back to the HTTP handler.

The scheduler thread calls :meth:`Job.emit`; the handler awaits :meth:`Job.events` on the event
loop. The hand-over is ``loop.call_soon_threadsafe`` into an ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from precache.config import SamplingParams

_ids = itertools.count()


@dataclass(frozen=True)
class TokenEvent:
    """A sampled token and the text it adds ("" for an end-of-sequence token)."""

    token_id: int
    text: str


@dataclass(frozen=True)
class DoneEvent:
    """The turn is over. ``finish_reason``: ``"stop"`` (EOS or a stop string) or ``"length"``;
    token counts in tokens; ``cached_tokens``: prompt tokens read from the cache, not prefilled."""

    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    session_id: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed after it was accepted (HTTP ``status``)."""

    status: int
    message: str
    code: str | None = None


Event = TokenEvent | DoneEvent | ErrorEvent


@dataclass
class Job:
    """One request: ``agent`` (adapter name, None: base model) continues ``prompt_ids``.

    ``model`` is the name the client asked for (metrics label); ``arrival`` a ``perf_counter``
    time in seconds; ``session_id`` pins a trajectory.
    """

    agent: str | None
    prompt_ids: list[int]
    params: SamplingParams
    model: str = ""
    session_id: str | None = None
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
        """Events until (and with) the final :class:`DoneEvent` or :class:`ErrorEvent`."""
        while True:
            event = await self.queue.get()
            yield event
            if not isinstance(event, TokenEvent):
                return
