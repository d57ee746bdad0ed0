"""Evaluate the agents on a benchmark's questions: its metrics (HotpotQA: EM, F1; ScienceQA:
option accuracy), TTFT, and agreement with a reference method.

Agreement is the share of questions whose final answers are equal (HotpotQA: after answer
normalisation; ScienceQA: the same option) between the evaluated method and the reference (NonShared, the exact per-agent computation):
a lossless sharing method should agree on nearly every question under greedy decoding.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from statistics import mean
from typing import Any

from precache.agents.benchmark import HOTPOTQA, Benchmark
from precache.agents.loop import AgentSession, Episode, run_episode
from precache.engine.concurrency import run_concurrently

logger = logging.getLogger(__name__)


def summarize(
    episodes: list[Episode],
    reference: list[Episode] | None = None,
    benchmark: Benchmark = HOTPOTQA,
    questions: list[Any] | None = None,
) -> dict:
    """Aggregate episodes: the mean of each of ``benchmark.metrics`` (HotpotQA: ``em``, ``f1``;
    ScienceQA: ``accuracy``), mean TTFT (seconds) and prefill tokens per agent, stop reasons.

    With ``reference`` (same questions, same order), adds ``agreement``: the share of equal final
    answers by ``benchmark.answer_key`` over ``questions`` (the episodes' questions, in order;
    needed by ScienceQA, whose key is the option an answer names).

    Raises:
        ValueError: ``reference`` covers other questions, or ``questions`` are missing for it.
    """
    summary: dict = {"questions": len(episodes)}
    for metric in benchmark.metrics:
        summary[metric] = mean(getattr(e, metric) for e in episodes) if episodes else 0.0
    summary |= {
        "stop_reasons": dict(Counter(e.stop_reason for e in episodes)),
        "mean_steps": mean(e.steps for e in episodes) if episodes else 0.0,
        "agents": {},
    }
    turns_by_agent: dict[str, list] = {}
    for episode in episodes:
        for turn in episode.turns:
            turns_by_agent.setdefault(turn.agent, []).append(turn)
    for agent, turns in sorted(turns_by_agent.items()):
        summary["agents"][agent] = {
            "turns": len(turns),
            "mean_ttft_s": mean(t.ttft_s for t in turns),
            "mean_prefill_tokens": mean(t.prefill_tokens for t in turns),
            "mean_decode_s": mean(t.decode_s for t in turns),
        }
    if reference is not None:
        if [e.question_id for e in reference] != [e.question_id for e in episodes]:
            raise ValueError("reference episodes cover other questions than the evaluated ones")
        if questions is None and benchmark is not HOTPOTQA:
            raise ValueError(f"agreement on {benchmark.name} needs the episodes' questions")
        asked = questions if questions is not None else [None] * len(episodes)
        same = [
            benchmark.answer_key(a.answer, q) == benchmark.answer_key(b.answer, q)
            for a, b, q in zip(episodes, reference, asked, strict=True)
        ]
        summary["agreement"] = mean(same) if same else 0.0
    return summary


def evaluate(
    new_session: Callable[[], AgentSession],
    questions: list[Any],
    reference_session: Callable[[], AgentSession] | None = None,
    concurrency: int = 1,
    benchmark: Benchmark = HOTPOTQA,
    **episode_kwargs,
) -> dict:
    """Run one episode per question of ``benchmark`` (then one per question on the reference, if
    given).

    ``new_session`` / ``reference_session`` return a fresh engine session per question;
    ``concurrency`` episodes run at once on threads, so their forwards share batches
    (:func:`~precache.engine.concurrency.run_concurrently`; greedy answers do not depend on it but
    for floating-point batch effects). Returns ``{"summary": summarize(...), "episodes": [...],
    "reference_episodes": [...]}`` (episodes as dicts, in the order of ``questions``).
    """

    def runner(factory: Callable[[], AgentSession]) -> Callable[[Any], Episode]:
        return lambda question: run_episode(factory(), question, benchmark=benchmark, **episode_kwargs)

    episodes = run_concurrently(runner(new_session), questions, concurrency, desc="eval")
    for question, episode in zip(questions, episodes, strict=True):
        logger.debug("%s: %r (gold %r)", question.id, episode.answer, question.answer)
    reference = []
    if reference_session is not None:
        reference = run_concurrently(runner(reference_session), questions, concurrency, desc="reference")
    result = {
        "summary": summarize(
            episodes, reference if reference_session is not None else None, benchmark, questions
        ),
        "episodes": [e.to_dict() for e in episodes],
    }
    if reference_session is not None:
        result["reference_episodes"] = [e.to_dict() for e in reference]
    return result
