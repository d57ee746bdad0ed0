"""Uncertainty in every comparison ``precache study`` prints (issue 36): bootstrap confidence
intervals over questions, the paired test of each method against NonShared, stop reasons per
method, and the line that says which differences are inside noise.

Plain numpy over the stored per-question records of :func:`~precache.bench.study.stats.question_record`
(no scipy in the environment). Intervals are percentile bootstrap intervals (Efron & Tibshirani, "An
Introduction to the Bootstrap", 1993, ch. 13): resample the questions with replacement, recompute the
figure, take the 2.5th and 97.5th percentiles. A figure pooled over turns or tokens (the
teacher-forced KL) is resampled by question too, as a ratio of per-question sums, so the turns of one
question stay together. The paired test is the exact sign test of
:func:`~precache.bench.study.stats.sign_test` (McNemar's exact test for 0/1 measures).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from precache.bench.fidelity import REFERENCE
from precache.bench.study.stats import sign_test

RESAMPLES = 2000
LEVEL = 0.95
SEED = 0
#: a paired difference with p below this is "separated", otherwise "inside noise"
ALPHA = 0.05


def bootstrap_ci(
    num, den=None, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of ``sum(num) / sum(den)`` over questions (``den`` None: the
    mean of ``num``). ``num``, ``den``: one value per question ``[n]``. None when there is no
    question or the denominator of the data is zero.

    Raises:
        ValueError: ``num`` and ``den`` differ in length, or ``level`` is not in (0, 1).
    """
    num = np.asarray(num, dtype=np.float64)
    den = np.ones_like(num) if den is None else np.asarray(den, dtype=np.float64)
    if num.shape != den.shape:
        raise ValueError(f"num and den differ in length: {num.shape} against {den.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if num.size == 0 or den.sum() == 0:
        return None
    idx = np.random.default_rng(seed).integers(0, num.size, size=(resamples, num.size))
    d = den[idx].sum(1)
    stats = num[idx].sum(1)[d > 0] / d[d > 0]
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(stats, [tail, 100 - tail])
    return float(lo), float(hi)


def _kl_sums(record: dict) -> dict[str, tuple[float, float]]:
    """Per question: ``first_kl`` as (sum over turns, turns), ``mean_kl`` as (token-weighted sum,
    tokens), pooled as :func:`~precache.bench.episodes.summarize_turns` pools them."""
    forced = [t for t in record["forced"] if t.get("first_kl") is not None]
    return {
        "first_kl": (sum(t["first_kl"] for t in forced), len(forced)),
        "mean_kl": (sum(t["mean_kl"] * t["tokens"] for t in forced), sum(t["tokens"] for t in forced)),
    }


def method_intervals(records: list[dict], metrics) -> dict:
    """95% intervals of one method's ``agreement``, each of ``metrics`` and ``first_kl`` /
    ``mean_kl`` over its per-question records: ``{measure: [lo, hi] | None}``."""
    out = {}
    for measure in ("agreement", *metrics):
        key = "agrees" if measure == "agreement" else measure
        ci = bootstrap_ci([float(r[key]) for r in records])
        out[measure] = None if ci is None else list(ci)
    for measure in ("first_kl", "mean_kl"):
        sums = [_kl_sums(r)[measure] for r in records]
        ci = bootstrap_ci([s for s, _ in sums], [n for _, n in sums])
        out[measure] = None if ci is None else list(ci)
    return out


def paired_difference(a, b, resamples: int = RESAMPLES, seed: int = SEED) -> dict:
    """``a`` against ``b``, question by question (``[n]`` each): ``diff`` = mean(a - b), its
    bootstrap interval ``ci``, the questions where a is higher (``better``) / lower (``worse``) and
    the exact sign-test ``p``."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    better, worse = int((a > b).sum()), int((a < b).sum())
    ci = bootstrap_ci(a - b, resamples=resamples, seed=seed)
    return {
        "diff": float((a - b).mean()) if a.size else 0.0,
        "ci": None if ci is None else list(ci),
        "better": better,
        "worse": worse,
        "p": sign_test(better, worse),
    }


def stop_reasons(records: list[dict]) -> dict[str, int]:
    """How the method's episodes ended (``stop_reason`` of each record; ``"-"`` when not stored),
    most frequent first."""
    return dict(Counter(str(r.get("stop_reason") or "-") for r in records).most_common())


def uncertainty(per_question: list[dict], methods: list[str], metrics) -> dict:
    """For every method: ``intervals`` (:func:`method_intervals`), ``against_reference``
    (:func:`paired_difference` of each of ``metrics`` against NonShared) and ``stop_reasons``; and
    ``agreement_pairs``: the method with the highest agreement (NonShared left out) against each
    other one, question by question (``{"best", "against": {method: paired_difference}}``)."""
    records = {m: [q["methods"][m] for q in per_question] for m in methods}
    out: dict = {"methods": {}}
    for m in methods:
        rec, ref = records[m], records[REFERENCE]
        out["methods"][m] = {
            "intervals": method_intervals(rec, metrics),
            "against_reference": {
                metric: paired_difference([r[metric] for r in rec], [r[metric] for r in ref])
                for metric in metrics
            },
            "stop_reasons": stop_reasons(rec),
        }
    shared = [m for m in methods if m != REFERENCE and records[m]]
    if shared:
        agreement = {m: sum(r["agrees"] for r in records[m]) for m in shared}
        best = max(shared, key=lambda m: agreement[m])
        out["agreement_pairs"] = {
            "best": best,
            "against": {
                m: paired_difference(
                    [float(r["agrees"]) for r in records[best]], [float(r["agrees"]) for r in records[m]]
                )
                for m in shared
                if m != best
            },
        }
    return out


def conclusion(unc: dict, metrics) -> list[str]:
    """Lines that say which differences are inside noise (sign test p >= :data:`ALPHA`): each
    accuracy against NonShared, and the highest agreement against every other method."""
    lines = []
    for metric in metrics:
        inside, apart = [], []
        for m, part in unc["methods"].items():
            if m == REFERENCE:
                continue
            c = part["against_reference"][metric]
            (apart if c["p"] < ALPHA else inside).append(f"{m} ({c['diff']:+.3f}, p = {c['p']:.2g})")
        lines.append(
            f"- {metric} against NonShared: inside noise for {', '.join(inside) or 'none'}; "
            f"separated for {', '.join(apart) or 'none'}"
        )
    pairs = unc.get("agreement_pairs")
    if pairs:
        inside = [m for m, c in pairs["against"].items() if c["p"] >= ALPHA]
        apart = [m for m, c in pairs["against"].items() if c["p"] < ALPHA]
        lines.append(
            f"- agreement: the highest is {pairs['best']}'s; inside noise against "
            f"{', '.join(inside) or 'none'}; separated from {', '.join(apart) or 'none'} "
            f"(paired sign test, p < {ALPHA})"
        )
    return lines


def _ci(ci) -> str:
    return "-" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def uncertainty_markdown(run: dict) -> list[str]:
    """The report's lines for one run's ``uncertainty`` (none when the run has none): a table of
    intervals, paired tests against NonShared and stop reasons per method, then :func:`conclusion`."""
    unc, metrics = run.get("uncertainty"), run["metrics"]
    if not unc:
        return []
    table = run["table"]
    cols = ["agreement", *metrics, *(f"{m} - NonShared" for m in metrics), "first_kl", "mean_kl"]
    lines = [
        "",
        f"95% bootstrap intervals over questions ({RESAMPLES} resamples, seed {SEED}); differences "
        "against NonShared with the exact paired sign test; how the episodes ended:",
        "",
        "| method | " + " | ".join(cols) + " | stop reasons |",
        "|---" * (len(cols) + 2) + "|",
    ]
    for m, part in unc["methods"].items():
        iv, cells = part["intervals"], []
        for c in ("agreement", *metrics):
            cells.append(f"{table[m][c]:.3f} {_ci(iv[c])}")
        for metric in metrics:
            d = part["against_reference"][metric]
            cells.append(f"{d['diff']:+.3f} {_ci(d['ci'])}, p = {d['p']:.2g}")
        for c in ("first_kl", "mean_kl"):
            value = table[m][c]
            cells.append("-" if value is None else f"{value:.3f} {_ci(iv[c])}")
        stops = ", ".join(f"{k} {v}" for k, v in part["stop_reasons"].items())
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {stops} |")
    lines += ["", "Which differences are inside noise:", "", *conclusion(unc, metrics)]
    return lines


__all__ = [
    "ALPHA",
    "bootstrap_ci",
    "conclusion",
    "method_intervals",
    "paired_difference",
    "stop_reasons",
    "uncertainty",
    "uncertainty_markdown",
]
