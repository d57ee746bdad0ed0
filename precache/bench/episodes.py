"""Fidelity on agent episodes: record NonShared episodes, teacher-force them under every method,
run every method free, and summarise (KL, top-1, base-cache error, answer agreement, EM / F1).

Recording wraps the engine session in :class:`RecordingSession`, which the agent loop
(:func:`precache.agents.loop.run_episode`) drives like a plain session.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence

from rich.progress import Progress

from precache.bench.fidelity import REFERENCE, RecordedTurn, compare_trajectory

logger = logging.getLogger(__name__)


class RecordingSession:
    """An engine session that records each agent turn as a :class:`RecordedTurn`.

    Text is tokenised the way ``Session.append`` does it (no special tokens), so the recorded ids
    are exactly the trajectory's.
    """

    def __init__(self, session):
        self.session = session
        self.turns: list[RecordedTurn] = []
        self._pending: list[int] = []

    def append(self, content: str | Sequence[int]) -> int:
        ids = self.session.engine.encode(content) if isinstance(content, str) else [int(t) for t in content]
        n = self.session.append(ids)
        self._pending.extend(ids)
        return n

    def generate(self, agent: str, **kwargs):
        out = self.session.generate(agent=agent, **kwargs)
        self.turns.append(RecordedTurn(agent, tuple(self._pending), tuple(out.token_ids)))
        self._pending = []
        return out

    def __len__(self) -> int:
        return len(self.session)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize_turns(records: list[dict]) -> dict:
    """Means over agent turns: ``first_kl``, ``first_top1`` per turn; ``mean_kl``, ``top1`` per
    generated token; ``k_error`` / ``v_error`` over layers and turns with earlier segments, plus
    ``k_error_per_layer`` / ``v_error_per_layer`` (lists over layers)."""
    tokens = sum(r["tokens"] for r in records)
    with_prefix = [r for r in records if r["k_error"] is not None]
    out = {
        "turns": len(records),
        "first_kl": _mean([r["first_kl"] for r in records]),
        "first_top1": _mean([r["first_top1"] for r in records]),
        "mean_kl": sum(r["mean_kl"] * r["tokens"] for r in records) / tokens if tokens else None,
        "top1": sum(r["top1"] * r["tokens"] for r in records) / tokens if tokens else None,
    }
    for side in ("k_error", "v_error"):
        per_layer = [_mean(list(layer)) for layer in zip(*(r[side] for r in with_prefix), strict=True)]
        out[f"{side}_per_layer"] = per_layer
        out[side] = _mean(per_layer) if per_layer else None
    return out


def _answers(episodes: list, reference: list) -> dict:
    from precache.agents.scoring import normalize_answer

    same = [
        normalize_answer(a.answer) == normalize_answer(b.answer)
        for a, b in zip(episodes, reference, strict=True)
    ]
    return {
        "agreement": _mean([float(s) for s in same]),
        "em": _mean([e.em for e in episodes]),
        "f1": _mean([e.f1 for e in episodes]),
        "answers": [e.answer for e in episodes],
    }


def run_fidelity(engines: dict, questions: list, reference: str = REFERENCE, **episode_kwargs) -> dict:
    """Fidelity of every engine (by method name) against ``engines[reference]`` on ``questions``.

    ``episode_kwargs`` go to :func:`precache.agents.loop.run_episode` (``max_steps``,
    ``max_new_tokens``). Returns ``{"episodes", "turns", "methods": {name: summary},
    "per_turn": {name: [records]}}``; a summary has :func:`summarize_turns`'s fields plus
    ``agreement`` (share of normalised final answers equal to the reference's, free-running),
    ``em`` and ``f1``.
    """
    from precache.agents.loop import run_episode

    recorded, ref_episodes = [], []
    per_turn: dict[str, list[dict]] = {name: [] for name in engines}
    free: dict[str, list] = {name: [] for name in engines}
    with Progress(transient=True) as progress:
        task = progress.add_task("fidelity", total=len(questions) * (len(engines) + 1))
        for question in questions:
            rec = RecordingSession(engines[reference].session())
            ref_episodes.append(run_episode(rec, question, **episode_kwargs))
            recorded.append(rec.turns)
            progress.advance(task)
            for name, records in compare_trajectory(engines, rec.turns, reference).items():
                per_turn[name].extend({"question": question.id, **r} for r in records)
            for name, engine in engines.items():
                episode = (
                    ref_episodes[-1]
                    if name == reference
                    else run_episode(engine.session(), question, **episode_kwargs)
                )
                free[name].append(episode)
                progress.advance(task)
    methods = {
        name: {**summarize_turns(per_turn[name]), **_answers(free[name], ref_episodes)} for name in engines
    }
    return {
        "episodes": len(questions),
        "turns": sum(len(t) for t in recorded),
        "reference": reference,
        "methods": methods,
        "per_turn": per_turn,
    }
