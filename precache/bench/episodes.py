"""Fidelity on agent episodes: record NonShared episodes, teacher-force them under every method,
run every method free, and summarise (KL, top-1, base-cache error, answer agreement, EM / F1).

Recording wraps the engine session in :class:`RecordingSession`, which the agent loop
(:func:`precache.agents.loop.run_episode`) drives like a plain session. Every phase runs
``concurrency`` episodes (or trajectories) at once, their forwards batched in each engine
(:func:`~precache.engine.concurrency.run_concurrently`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence

from precache.agents.benchmark import get_benchmark
from precache.agents.loop import run_episode
from precache.bench.fidelity import REFERENCE, compare_trajectory
from precache.engine.concurrency import run_concurrently
from precache.engine.request import Turn

logger = logging.getLogger(__name__)


class RecordingSession:
    """An engine session that keeps each agent turn (:class:`Turn`, with the ids appended before it)."""

    def __init__(self, session):
        self.session = session
        self.turns: list[Turn] = []

    def append(self, content: str | Sequence[int]) -> int:
        return self.session.append(content)

    def generate(self, agent: str, **kwargs) -> Turn:
        turn = self.session.generate(agent=agent, **kwargs)
        self.turns.append(turn)
        return turn

    def __len__(self) -> int:
        return len(self.session)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize_turns(records: list[dict]) -> dict:
    """Means over agent turns: ``first_kl``, ``first_top1`` per turn; ``mean_kl``, ``top1`` per
    generated token; ``k_error`` / ``v_error`` over layers and turns with earlier segments, plus
    ``k_error_per_layer`` / ``v_error_per_layer`` (lists over layers); likewise the ``_own`` /
    ``_other`` split of :mod:`precache.bench.fidelity` over the turns that have such positions
    (None when no turn has)."""
    tokens = sum(r["tokens"] for r in records)
    out = {
        "turns": len(records),
        "first_kl": _mean([r["first_kl"] for r in records]),
        "first_top1": _mean([r["first_top1"] for r in records]),
        "mean_kl": sum(r["mean_kl"] * r["tokens"] for r in records) / tokens if tokens else None,
        "top1": sum(r["top1"] * r["tokens"] for r in records) / tokens if tokens else None,
    }
    for side in ("k_error", "v_error", "k_error_own", "v_error_own", "k_error_other", "v_error_other"):
        with_part = [r[side] for r in records if r.get(side) is not None]
        per_layer = [_mean(list(layer)) for layer in zip(*with_part, strict=True)]
        out[f"{side}_per_layer"] = per_layer
        out[side] = _mean(per_layer) if per_layer else None
    return out


def _answers(episodes: list, reference: list, questions: list, benchmark) -> dict:
    same = [
        benchmark.answer_key(a.answer, q) == benchmark.answer_key(b.answer, q)
        for a, b, q in zip(episodes, reference, questions, strict=True)
    ]
    return {
        "agreement": _mean([float(s) for s in same]),
        **{metric: _mean([getattr(e, metric) for e in episodes]) for metric in benchmark.metrics},
        "answers": [e.answer for e in episodes],
    }


def run_fidelity(
    engines: dict, questions: list, reference: str = REFERENCE, concurrency: int = 1, **episode_kwargs
) -> dict:
    """Fidelity of every engine (by method name) against ``engines[reference]`` on ``questions``.

    ``episode_kwargs`` go to :func:`precache.agents.loop.run_episode` (``max_steps``,
    ``max_new_tokens``, ``benchmark``: HotpotQA unless given); ``concurrency`` questions run at
    once. Returns ``{"benchmark", "metrics", "episodes", "turns", "methods": {name: summary},
    "per_turn": {name: [records]}}`` (in the order of ``questions``); a summary has
    :func:`summarize_turns`'s fields plus ``agreement`` (share of free-running final answers whose
    ``benchmark.answer_key`` equals the reference's: the normalised answer on HotpotQA, the option
    letter on ScienceQA) and the benchmark's metrics (EM and F1; option accuracy).
    """
    benchmark = episode_kwargs.get("benchmark") or get_benchmark("hotpotqa")

    def record(question):
        rec = RecordingSession(engines[reference].session())
        return run_episode(rec, question, **episode_kwargs), rec.turns

    recorded = run_concurrently(record, questions, concurrency, desc=f"record {reference}")
    ref_episodes = [episode for episode, _ in recorded]
    compared = run_concurrently(
        lambda rec: compare_trajectory(engines, rec[1], reference),
        recorded,
        concurrency,
        desc="teacher-force",
    )
    per_turn: dict[str, list[dict]] = {name: [] for name in engines}
    for question, by_method in zip(questions, compared, strict=True):
        for name, records in by_method.items():
            per_turn[name].extend({"question": question.id, **r} for r in records)
    free: dict[str, list] = {reference: ref_episodes}
    for name, engine in engines.items():
        if name != reference:
            free[name] = run_concurrently(
                lambda q, engine=engine: run_episode(engine.session(), q, **episode_kwargs),
                questions,
                concurrency,
                desc=f"free {name}",
            )
    methods = {
        name: {**summarize_turns(per_turn[name]), **_answers(free[name], ref_episodes, questions, benchmark)}
        for name in engines
    }
    return {
        "benchmark": benchmark.name,
        "metrics": list(benchmark.metrics),
        "episodes": len(questions),
        "turns": sum(len(turns) for _, turns in recorded),
        "reference": reference,
        "methods": methods,
        "per_turn": per_turn,
    }
