"""A request's lifecycle: its states (:class:`RequestState`), its turn's phases (:class:`Phase`),
and what it reads of its session and reports to it (:class:`TurnHost`), so that the request
(:mod:`precache.engine.request`) and the session (:mod:`precache.engine.session`) never import
each other both ways: the session builds requests; a request knows its session only as a
:class:`TurnHost`.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

from precache.engine.outputs import Turn


class RequestState(enum.Enum):
    """Where a request is: queued, in the batch, swapped out, or over (with a result, cancelled, or
    failed)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


class Phase(enum.Enum):
    """Where the open turn is: ``PREFILL`` -> ``DECODE`` -> (``POST``: the post-turn pass) -> ``DONE``."""

    PREFILL = "prefill"
    DECODE = "decode"
    POST = "post"
    DONE = "done"


class TurnHost(Protocol):
    """What a request needs of its session (:class:`~precache.engine.session.Session`): the fields
    it reads, and the methods it reports through (the session writes its own fields):
    ``start_turn(request)``: the turn is open; ``extend_authors(agent, end)``: the tokens up to
    ``end`` were processed first by ``agent``; ``add_token(token_id)``: a generated token joins the
    trajectory; ``close_turn()``: the last token is out; ``commit_turn(turn)``: the turn is over
    and ``turn`` is its record; ``release_turn(request)``: the request failed, the session is free."""

    engine: Any
    method: Any
    state: Any
    id: str
    token_ids: list[int]
    authors: list[str | None]
    last_turn_end: int
    swapped: Any

    def start_turn(self, request: object) -> None: ...  # a Request (no import: no cycle)
    def extend_authors(self, agent: str | None, end: int) -> None: ...
    def add_token(self, token_id: int) -> None: ...
    def close_turn(self) -> None: ...
    def commit_turn(self, turn: Turn) -> None: ...
    def release_turn(self, request: object) -> None: ...
    def note_cache_bytes(self) -> None: ...
    def cache_bytes(self) -> dict: ...
