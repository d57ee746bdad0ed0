"""Gold trajectories, as the loop would write them: HotpotQA's from its supporting facts here,
and what every benchmark's gold trajectories share (the seeded set of :func:`gold_trajectories`,
the ending of :func:`gold_ending`).

A positive trajectory retrieves each supporting title in turn, finishes with the gold answer
and reflects ``right``. A negative one first finishes with a wrong answer (a paragraph title
that is not the answer, or the flipped yes/no), reflects ``wrong``, then retries with the gold
answer and reflects ``right``, so the reflect adapter sees both verdicts and the plan adapter
sees a retry. Observations come from :class:`ToolEnv`, exactly as at inference.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from precache.agents import prompt
from precache.agents.data import Question
from precache.agents.scoring import normalize_answer
from precache.agents.tools import ToolEnv

_FIRST_THOUGHTS = ("I need to search {title}.", "I should look up {title} first.")
_NEXT_THOUGHTS = ("Next I need to search {title}.", "Now I should look up {title}.")
_FINISH_THOUGHT = "I have the information to answer."
#: the plan's thought before it answers again after ``Reflect[wrong]``
RETRY_THOUGHT = "My answer was judged wrong. Let me answer again."


def wrong_answer(question: Question, rng: random.Random) -> str:
    """A plausible wrong answer: the other of yes/no, or a paragraph title that is not the answer."""
    gold = normalize_answer(question.answer)
    if gold in ("yes", "no"):
        return "no" if gold == "yes" else "yes"
    candidates = [t for t in question.titles if normalize_answer(t) != gold]
    return rng.choice(candidates) if candidates else "unknown"


def _finish(answer: str, thought: str, verdict: str) -> list[prompt.Piece]:
    return [
        prompt.Piece("plan", prompt.plan_text(thought, "Finish")),
        prompt.Piece("action", prompt.action_text(answer)),
        prompt.Piece("env", prompt.FINISH_SEPARATOR),
        prompt.Piece("reflect", prompt.reflect_text(verdict)),
    ]


def gold_ending(answer: str, thought: str, wrong: str | None = None) -> list[prompt.Piece]:
    """The pieces that end a gold trajectory: ``Finish[answer]`` after ``thought`` and
    ``Reflect[right]``; with a ``wrong`` answer, first ``Finish[wrong]`` after ``thought`` and
    ``Reflect[wrong]``, then a retry with ``answer`` and ``Reflect[right]``."""
    if wrong is None:
        return _finish(answer, thought, "right")
    retry = prompt.Piece("env", prompt.RETRY_SEPARATOR)
    return [*_finish(wrong, thought, "wrong"), retry, *_finish(answer, RETRY_THOUGHT, "right")]


def gold_trajectory(question: Question, rng: random.Random, negative: bool = False) -> list[prompt.Piece]:
    """The pieces of one gold trajectory (see module docstring), starting with the header."""
    env = ToolEnv(question)
    pieces = [prompt.Piece("env", prompt.header(question.question))]
    for i, title in enumerate(question.supporting_titles):
        template = rng.choice(_FIRST_THOUGHTS if i == 0 else _NEXT_THOUGHTS)
        result = env.step(f"Retrieve[{title}]")
        pieces += [
            prompt.Piece("plan", prompt.plan_text(template.format(title=title), "Retrieve")),
            prompt.Piece("action", prompt.action_text(title)),
            prompt.Piece("env", prompt.observation_text(result.observation)),
        ]
    wrong = wrong_answer(question, rng) if negative else None
    return pieces + gold_ending(question.answer, _FINISH_THOUGHT, wrong)


def gold_trajectories(
    questions: list,
    seed: int = 0,
    negative_fraction: float = 0.4,
    trajectory: Callable[..., list[prompt.Piece]] = gold_trajectory,
) -> list[list[prompt.Piece]]:
    """One trajectory per question, ``trajectory(question, rng, negative=...)`` (HotpotQA's
    :func:`gold_trajectory` unless a benchmark passes its own), about ``negative_fraction`` of them
    negative; one ``random.Random(seed)`` draws them all, so a seed gives the same set."""
    rng = random.Random(seed)
    return [trajectory(q, rng, negative=rng.random() < negative_fraction) for q in questions]
