"""Gold trajectories from HotpotQA supporting facts, as the loop would write them.

A positive trajectory retrieves each supporting title in turn, finishes with the gold answer
and reflects ``right``. A negative one first finishes with a wrong answer (a paragraph title
that is not the answer, or the flipped yes/no), reflects ``wrong``, then retries with the gold
answer and reflects ``right``, so the reflect adapter sees both verdicts and the plan adapter
sees a retry. Observations come from :class:`ToolEnv`, exactly as at inference.
"""

from __future__ import annotations

import random

from precache.agents import prompt
from precache.agents.data import Question
from precache.agents.scoring import normalize_answer
from precache.agents.tools import ToolEnv

_FIRST_THOUGHTS = ("I need to search {title}.", "I should look up {title} first.")
_NEXT_THOUGHTS = ("Next I need to search {title}.", "Now I should look up {title}.")
_FINISH_THOUGHT = "I have the information to answer."
_RETRY_THOUGHT = "My answer was judged wrong. Let me answer again."


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
    if negative:
        pieces += _finish(wrong_answer(question, rng), _FINISH_THOUGHT, "wrong")
        pieces.append(prompt.Piece("env", prompt.RETRY_SEPARATOR))
        pieces += _finish(question.answer, _RETRY_THOUGHT, "right")
    else:
        pieces += _finish(question.answer, _FINISH_THOUGHT, "right")
    return pieces


def gold_trajectories(
    questions: list[Question], seed: int = 0, negative_fraction: float = 0.4
) -> list[list[prompt.Piece]]:
    """One trajectory per question; about ``negative_fraction`` of them negative (seeded)."""
    rng = random.Random(seed)
    return [gold_trajectory(q, rng, negative=rng.random() < negative_fraction) for q in questions]
