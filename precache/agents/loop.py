"""The plan / action / reflect loop on one shared trajectory (protocol: :mod:`precache.agents.prompt`).

The loop talks to the engine only through the session contract below (its turns are the engine's
:class:`~precache.engine.request.Turn` records); every agent continues the same token stream and no
agent gets prompt text of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from precache.agents import prompt
from precache.agents.benchmark import HOTPOTQA, Benchmark
from precache.engine.request import Turn
from precache.errors import ContextLengthError

logger = logging.getLogger(__name__)

STOP_REASONS = ("reflect_right", "retries_exhausted", "reflect_unparsed", "max_steps", "context_length")


class AgentSession(Protocol):
    """The engine session contract the loop relies on (``precache.Engine.session()``)."""

    def append(self, text_or_token_ids: str | Sequence[int]) -> Any: ...

    def generate(self, agent: str, max_new_tokens: int, temperature: float, stop: list[str]) -> Turn: ...

    def __len__(self) -> int: ...


@dataclass
class Episode:
    """The result of :func:`run_episode`. ``stop_reason`` is one of ``STOP_REASONS``.

    ``em`` / ``f1`` are HotpotQA's scores (left at 0.0 on ScienceQA); ``accuracy`` is
    ScienceQA's option accuracy (None on a benchmark that does not measure it, and then left out
    of :meth:`to_dict`).
    """

    question_id: str
    turns: list[Turn] = field(default_factory=list)
    pieces: list[prompt.Piece] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    answer: str = ""
    em: float = 0.0
    f1: float = 0.0
    accuracy: float | None = None
    stop_reason: str = ""
    steps: int = 0
    wall_s: float = 0.0

    @property
    def trajectory(self) -> str:
        """The whole trajectory text, piece by piece as appended and generated."""
        return "".join(piece.text for piece in self.pieces)

    def to_dict(self) -> dict:
        """JSON-ready summary (turns as :meth:`Turn.summary`, pieces folded into ``trajectory``)."""
        skip = ("turns", "pieces") if self.accuracy is not None else ("turns", "pieces", "accuracy")
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        data["answers"] = list(self.answers)
        data["turns"] = [turn.summary() for turn in self.turns]
        data["trajectory"] = self.trajectory
        return data


class _Stop(Exception):
    """Ends the episode with a stop reason (context full)."""


class _Runner:
    """State of one episode: the session, the tools, the pieces written so far."""

    def __init__(self, session, question, max_new_tokens, max_context, on_turn, benchmark) -> None:
        self.session = session
        self.env = benchmark.environment(question)
        self.max_new_tokens = max_new_tokens
        self.max_context = max_context
        self.on_turn = on_turn
        self.episode = Episode(question_id=question.id)

    def append(self, text: str) -> None:
        self.episode.pieces.append(prompt.Piece("env", text))
        try:
            self.session.append(text)
        except ContextLengthError as exc:
            raise _Stop("context_length") from exc
        if self.max_context is not None and len(self.session) > self.max_context:
            raise _Stop("context_length")

    def generate(self, agent: str) -> str:
        if self.max_context is not None and len(self.session) + self.max_new_tokens > self.max_context:
            raise _Stop("context_length")
        try:
            turn = self.session.generate(
                agent=agent,
                max_new_tokens=self.max_new_tokens,
                temperature=0.0,
                stop=prompt.STOP_STRINGS[agent],
            )
        except ContextLengthError as exc:
            raise _Stop("context_length") from exc
        self.episode.turns.append(turn)
        # every generated token stays in the trajectory: the piece is the returned text plus what
        # the stop rule cut (the stop string and any overshoot), which the parsers read
        written = turn.text + turn.trimmed
        self.episode.pieces.append(prompt.Piece(agent, written))
        if self.on_turn is not None:
            self.on_turn(turn)
        return written

    def act(self) -> tuple[str, str] | None:
        """One plan (+ action) step. Returns ``(kind, argument)``, or None after an error observation."""
        plan = self.generate("plan")
        parsed = prompt.parse_plan(plan)
        if parsed is None:
            self.append(
                prompt.observation_text("Invalid step. Write Thought: ... then Action: Type[argument].")
            )
            return None
        kind = parsed[1]
        written = prompt.plan_overshoot(plan)  # a token past "[" may start the argument
        if "]" not in written:
            written += self.generate("action")
        argument = prompt.parse_argument(written)
        if argument is None:
            self.append(prompt.observation_text(f"Invalid action: {kind}[ was not closed with ]."))
            return None
        return kind, argument

    def reflect(self) -> str | None:
        """The reflect agent's verdict on the answer just given (``right`` / ``wrong`` / None)."""
        self.append(prompt.FINISH_SEPARATOR)
        return prompt.parse_reflect(self.generate("reflect"))


def run_episode(
    session: AgentSession,
    question: Any,
    max_steps: int = 8,
    max_new_tokens: int = 64,
    max_retries: int = 1,
    max_context: int | None = None,
    on_turn: Callable[[Turn], None] | None = None,
    benchmark: Benchmark = HOTPOTQA,
) -> Episode:
    """Answer ``question`` (one of ``benchmark``'s) with the three agents taking turns on
    ``session``'s one trajectory; the first piece and the tools are the benchmark's.

    A step is one plan turn (plus the action turn it calls for). ``Finish[answer]`` is followed
    by a reflect turn; ``Reflect[wrong]`` starts another attempt, at most ``max_retries`` times.
    Stops cleanly (``Episode.stop_reason``) on ``Reflect[right]``, exhausted retries, an
    unparseable verdict, ``max_steps`` steps, or when the next piece would not fit in
    ``max_context`` tokens (default: ``session.max_context`` if it has one, else unbounded).
    The answer is the last ``Finish`` argument ("" if none), scored by ``benchmark.score``
    (HotpotQA: EM / F1 against the gold answer; ScienceQA: option accuracy).
    """
    start = time.perf_counter()
    if max_context is None:
        max_context = getattr(session, "max_context", None)
    run = _Runner(session, question, max_new_tokens, max_context, on_turn, benchmark)
    episode = run.episode
    retries = 0
    try:
        run.append(benchmark.header(question))
        while True:
            if episode.steps >= max_steps:
                raise _Stop("max_steps")
            episode.steps += 1
            action = run.act()
            if action is None:
                continue
            result = run.env.step(f"{action[0]}[{action[1]}]")
            if not result.done:
                run.append(prompt.observation_text(result.observation))
                continue
            episode.answers.append(result.answer)
            verdict = run.reflect()
            if verdict == "wrong" and retries < max_retries:
                retries += 1
                run.append(prompt.RETRY_SEPARATOR)
                continue
            raise _Stop(
                {"right": "reflect_right", "wrong": "retries_exhausted"}.get(verdict, "reflect_unparsed")
            )
    except _Stop as stop:
        episode.stop_reason = str(stop)
    episode.answer = episode.answers[-1] if episode.answers else ""
    for metric, value in benchmark.score(episode.answer, question).items():
        setattr(episode, metric, value)
    episode.wall_s = time.perf_counter() - start
    logger.debug("episode %s: %s after %d steps", question.id, episode.stop_reason, episode.steps)
    return episode
