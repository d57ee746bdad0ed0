"""The statistics of ``precache study`` (:mod:`precache.bench.study`): one question's record, the
paper-style table over the stored questions, and the question-by-question comparison of two methods.

Everything here is plain Python over the JSON-ready entries that :mod:`precache.bench.study.run`
produces and :class:`~precache.bench.study.store.PointStore` keeps: no model, no engine.
"""

from __future__ import annotations

import math

from precache.bench.episodes import summarize_turns
from precache.bench.fidelity import REFERENCE


def matching_turns(turns: list, reference: list) -> int:
    """How many turns of an episode equal the reference's (same agent, same appended ids, same
    generated ids), counted in order while every earlier turn matched: once the free-running
    trajectories part, no later turn is compared (its context differs)."""
    same = 0
    for turn, ref in zip(turns, reference, strict=False):
        if (turn.agent, tuple(turn.appended), list(turn.token_ids)) != (
            ref.agent,
            tuple(ref.appended),
            list(ref.token_ids),
        ):
            break
        same += 1
    return same


def question_record(episode, reference, benchmark, question, forced: dict) -> dict:
    """What the table keeps of one method on one question (JSON-ready, stored by
    :class:`~precache.bench.study.store.PointStore`): ``answer``, each of ``benchmark.metrics``,
    ``agrees`` (the answer's ``benchmark.answer_key`` equals the reference's), ``matched``
    (:func:`matching_turns`) and ``reference_turns``, the sums of TTFT (seconds) and prefill tokens
    over its turns, and ``forced``: the teacher-forced per-turn records of
    :func:`~precache.bench.fidelity.compare_trajectory`."""
    return {
        "answer": episode.answer,
        **{metric: getattr(episode, metric) for metric in benchmark.metrics},
        "agrees": benchmark.answer_key(episode.answer, question)
        == benchmark.answer_key(reference.answer, question),
        "matched": matching_turns(episode.turns, reference.turns),
        "reference_turns": len(reference.turns),
        "turns": len(episode.turns),
        "stop_reason": episode.stop_reason,
        "ttft_s": sum(t.ttft_s for t in episode.turns),
        "prefill_tokens": sum(t.prefill_tokens for t in episode.turns),
        "forced": forced,
    }


def method_row(records: list[dict], benchmark) -> dict:
    """One line of the table from one method's :func:`question_record` s (questions in order):
    the mean of each metric, ``agreement`` (share of agreeing answers), ``turn_match`` (matched
    turns over the reference's turns), ``sum_ttft_s``, ``prefill_tokens``, ``first_kl`` /
    ``mean_kl`` / ``top1`` and the cache errors ``k_error`` (all earlier positions), ``k_error_own``
    / ``v_error_own`` (the reader's own earlier segments) and ``k_error_other`` / ``v_error_other``
    (the other agents') of the forced records (:func:`~precache.bench.episodes.summarize_turns`,
    :mod:`~precache.bench.fidelity`), ``kv_bytes`` (:func:`_final_kv_bytes`), ``answers``, and the same measures per agent
    (:func:`by_agent`). ``{metric}_drop`` is added by :func:`table`."""
    n = len(records)
    total = sum(r["reference_turns"] for r in records)
    forced = summarize_turns([t for r in records for t in r["forced"]])
    return {
        **{metric: sum(r[metric] for r in records) / n if n else 0.0 for metric in benchmark.metrics},
        "agreement": sum(r["agrees"] for r in records) / n if n else 0.0,
        "turn_match": sum(r["matched"] for r in records) / total if total else None,
        "sum_ttft_s": sum(r["ttft_s"] for r in records),
        "prefill_tokens": sum(r["prefill_tokens"] for r in records),
        **{key: forced[key] for key in ("first_kl", "mean_kl", "top1")},
        **{
            key: forced[key]
            for key in ("k_error", "k_error_own", "k_error_other", "v_error_own", "v_error_other")
        },
        "kv_bytes": _final_kv_bytes(records),
        "answers": [r["answer"] for r in records],
        "by_agent": by_agent([t for r in records for t in r["forced"]]),
    }


def _final_kv_bytes(records: list[dict]) -> float | None:
    """Mean over questions of the bytes the trajectory's caches hold after its last teacher-forced
    turn (:func:`~precache.bench.fidelity.held_bytes`); None when a question has no such record
    (stored before it was measured)."""
    last = [r["forced"][-1].get("kv_bytes") if r["forced"] else None for r in records]
    if not last or any(b is None for b in last):
        return None
    return sum(last) / len(last)


def by_agent(forced: list[dict]) -> dict:
    """The teacher-forced measures per agent (the turn's reader): ``{agent: {"turns", "first_kl",
    "mean_kl", "top1", "k_error_own", "k_error_other"}}``
    (:func:`~precache.bench.episodes.summarize_turns` over that agent's turns). Where a method
    loses fidelity shows here: on the turns that re-read the agent's own earlier segments or on
    those that read the other agents'."""
    agents = sorted({r["agent"] for r in forced}, key=str)
    keys = ("turns", "first_kl", "mean_kl", "top1", "k_error_own", "k_error_other")
    out = {}
    for agent in agents:
        summary = summarize_turns([r for r in forced if r["agent"] == agent])
        out[str(agent)] = {key: summary[key] for key in keys}
    return out


def parted_at(per_question: list[dict], method: str) -> dict:
    """Where ``method``'s free-running episodes part from NonShared's: per agent, on how many
    questions the first turn that differs (:func:`matching_turns`) is that agent's (``"none"``: no
    turn differs)."""
    counts: dict[str, int] = {}
    for q in per_question:
        record, reference = q["methods"][method], q["methods"][REFERENCE]["forced"]
        agent = (
            "none"
            if record["matched"] >= record["reference_turns"]
            else str(reference[record["matched"]]["agent"])
        )
        counts[agent] = counts.get(agent, 0) + 1
    return dict(sorted(counts.items()))


def table(per_question: list[dict], benchmark, methods: list[str]) -> dict:
    """``{method: method_row}`` over the stored questions, with ``{metric}_drop`` = the reference's
    (NonShared's) metric minus the method's (positive: a loss) and ``parted_at`` (:func:`parted_at`)."""
    rows = {m: method_row([q["methods"][m] for q in per_question], benchmark) for m in methods}
    for m, row in rows.items():
        row["parted_at"] = parted_at(per_question, m)
    for row in rows.values():
        for metric in benchmark.metrics:
            row[f"{metric}_drop"] = rows[REFERENCE][metric] - row[metric]
    return rows


def paired(entries: list[dict], method: str, other: str, benchmark) -> dict:
    """Question by question, ``method`` against ``other``: for ``agrees`` (the answer equals
    NonShared's) and each of ``benchmark.metrics``, how many questions ``method`` scores higher
    (``better``) and lower (``worse``), and the exact two-sided sign-test p-value of that split
    (McNemar's exact test for the 0/1 measures: under "neither is better" each discordant question
    goes either way with probability 1/2). Empty when either method did not run."""
    if not entries or any(m not in entries[0]["methods"] for m in (method, other)):
        return {}
    out = {}
    for measure in ("agrees", *benchmark.metrics):
        a = [float(q["methods"][method][measure]) for q in entries]
        b = [float(q["methods"][other][measure]) for q in entries]
        better = sum(x > y for x, y in zip(a, b, strict=True))
        worse = sum(x < y for x, y in zip(a, b, strict=True))
        out[measure] = {"better": better, "worse": worse, "p": sign_test(better, worse)}
    return out


def sign_test(better: int, worse: int) -> float:
    """Exact two-sided sign-test p-value of ``better`` against ``worse`` (ties dropped):
    ``min(1, 2 P[X <= min(better, worse)])`` for X ~ Binomial(better + worse, 1/2)."""
    n = better + worse
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(better, worse) + 1)) / 2**n
    return min(1.0, 2 * tail)


def rebase_beats(point: dict, metric: str) -> dict:
    """Whether ReBaseShared (LP) does better than PreLRShared at one sweep point (a :func:`table`):
    lower ``first_kl`` / ``mean_kl``, higher ``agreement`` and ``metric``; empty when either method
    is missing or has no question."""
    pre, rebase = point.get("prelrshared"), point.get("rebaseshared-lp")
    if pre is None or rebase is None:
        return {}
    if any(row[m] is None for row in (pre, rebase) for m in ("first_kl", "mean_kl", "agreement", metric)):
        return {}  # no question
    return {
        "first_kl": rebase["first_kl"] < pre["first_kl"],
        "mean_kl": rebase["mean_kl"] < pre["mean_kl"],
        "agreement": rebase["agreement"] > pre["agreement"],
        metric: rebase[metric] > pre[metric],
    }
