"""An HTTP generation request as the server loop sees it (the API's record of a request), and
what the loop sends back to its handler.

The server loop (:mod:`precache.server.loop`) calls :meth:`Job.emit`; the handler awaits
:meth:`JobGroup.events` (the jobs of one HTTP request) on the event loop. The hand-over is ``loop.call_soon_threadsafe`` into an
``asyncio.Queue``. Events are the engine's outputs as they are: each sampled token of choice
``index`` (:class:`~precache.engine.outputs.StreamChunk`), each choice's finished
:class:`~precache.engine.outputs.Turn`, or an :class:`ErrorEvent` that ends the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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


@dataclass
class Flow:
    """The events of one HTTP request between the server loop and its handler: ``emitted`` by the
    loop (its thread), ``taken`` by the handler (the event loop); their difference is what waits
    in memory for a client that reads slowly (the server loop holds the request when it passes
    ``ServerConfig.stream_buffer_events``). ``held_since``: ``time.monotonic()`` when the loop held
    it (None: running)."""

    emitted: int = 0
    taken: int = 0
    held_since: float | None = None

    @property
    def backlog(self) -> int:
        return self.emitted - self.taken


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
    base: int = 0  # the index of its first choice in the response (several prompts: prompt i * n)
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.perf_counter)
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    queue: asyncio.Queue | None = field(default=None, repr=False)
    flow: Flow = field(default_factory=Flow, repr=False)

    @property
    def n(self) -> int:
        """Choices asked for."""
        return self.params.n

    def bind(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue | None = None, flow: Flow | None = None
    ) -> Job:
        """Deliver events to ``loop`` (call on that loop before submitting), into ``queue`` and
        counted in ``flow`` when the job is one prompt of several (:class:`JobGroup`)."""
        self.loop, self.queue = loop, queue or asyncio.Queue()
        self.flow = flow or self.flow
        return self

    def emit(self, event: Event) -> None:
        """Send ``event`` to the handler (any thread), its choice index counted from ``base``;
        dropped when the loop is gone."""
        if self.loop is None:
            return
        if self.base and isinstance(event, StreamChunk | Turn):
            event = dataclasses.replace(event, index=event.index + self.base)
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
            self.flow.emitted += 1


@dataclass
class JobGroup:
    """The jobs of one HTTP request: one per prompt (a completions request may send a list), whose
    choices are numbered prompt by prompt (job ``i`` answers choices ``i * n .. i * n + n - 1``, the
    OpenAI order) and whose events arrive on one queue."""

    jobs: list[Job]
    turns: dict[int, Turn] = field(default_factory=dict)  # the choices' turns as they arrive

    @property
    def n(self) -> int:
        """Choices of the whole response."""
        return sum(job.n for job in self.jobs)

    @property
    def params(self) -> SamplingParams:
        return self.jobs[0].params

    def bind(self, loop: asyncio.AbstractEventLoop) -> JobGroup:
        queue: asyncio.Queue = asyncio.Queue()
        flow, base = Flow(), 0
        for job in self.jobs:
            job.base = base
            job.bind(loop, queue, flow)
            base += job.n
        return self

    async def events(self) -> AsyncIterator[Event]:
        """Every job's events until the last choice's :class:`Turn` or an :class:`ErrorEvent`."""
        queue, flow, left = self.jobs[0].queue, self.jobs[0].flow, self.n
        while left:
            event = await queue.get()
            flow.taken += 1
            yield event
            if isinstance(event, ErrorEvent):
                return
            if isinstance(event, Turn):
                self.turns[event.index] = event
                left -= 1

    def summary(self) -> str:
        """The access-log fields: model, tokens (prompt, cached, completion) and TTFT so far."""
        first = [self.turns[j.base] for j in self.jobs if j.base in self.turns]
        firsts = [j.first_token_s - j.arrival for j in self.jobs if j.first_token_s is not None]
        ttft = f"{min(firsts):.3f}s" if firsts else "-"
        return (
            f"model={self.jobs[0].model} prompt={sum(t.prompt_tokens for t in first)} "
            f"cached={sum(t.cached_tokens for t in first)} "
            f"completion={sum(t.new_tokens for t in self.turns.values())} ttft={ttft}"
        )
