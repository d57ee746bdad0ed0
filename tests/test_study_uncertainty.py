"""The study's uncertainty (issue 36) against known values: the exact sign / McNemar p-value of
constructed tables, bootstrap intervals that cover the mean and shrink with the number of
questions, the KL pooled by question, stop reasons, and the noise conclusion."""

from __future__ import annotations

import math

import numpy as np
import pytest

from precache.bench.study.stats import sign_test
from precache.bench.study.uncertainty import (
    bootstrap_ci,
    conclusion,
    method_intervals,
    paired_difference,
    stop_reasons,
    uncertainty,
    uncertainty_markdown,
)


def binomial_two_sided(k: int, n: int) -> float:
    """Exact two-sided binomial test at p = 1/2 by summing every outcome as likely or less likely
    than ``k`` (the definition scipy.stats.binomtest uses), written independently of sign_test."""
    pmf = [math.comb(n, i) / 2**n for i in range(n + 1)]
    return min(1.0, sum(p for p in pmf if p <= pmf[k] * (1 + 1e-7)))


@pytest.mark.parametrize(("b", "c"), [(0, 6), (1, 9), (3, 12), (7, 7), (18, 6), (30, 0)])
def test_mcnemar_exact_p_equals_the_binomial_test(b, c):
    """Discordant pairs b (method right, other wrong) and c: McNemar's exact p = binomial test."""
    assert sign_test(b, c) == pytest.approx(binomial_two_sided(min(b, c), b + c), rel=1e-9)


def test_known_sign_test_values():
    assert sign_test(0, 6) == pytest.approx(2 / 64)
    assert sign_test(1, 9) == pytest.approx(2 * 11 / 1024)
    assert sign_test(0, 0) == 1.0


def test_paired_difference_on_a_constructed_table():
    """10 questions: method right and NonShared wrong on 1, the reverse on 6, both right on 3."""
    a = [1] * 1 + [0] * 6 + [1] * 3
    b = [0] * 1 + [1] * 6 + [1] * 3
    out = paired_difference(a, b)
    assert (out["better"], out["worse"]) == (1, 6)
    assert out["diff"] == pytest.approx(-0.5)
    assert out["p"] == pytest.approx(2 * (1 + 7) / 128)
    lo, hi = out["ci"]
    assert lo < -0.5 < hi <= 0.0  # p = 0.125: the interval reaches 0


def test_bootstrap_covers_the_mean_and_shrinks_with_n():
    rng = np.random.default_rng(1)
    widths = []
    for n in (20, 80, 320):
        x = (rng.random(n) < 0.6).astype(float)
        lo, hi = bootstrap_ci(x)
        assert lo <= x.mean() <= hi
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]
    # about 2 * 1.96 * sqrt(p (1 - p) / n) for a proportion
    assert widths[2] == pytest.approx(2 * 1.96 * math.sqrt(0.24 / 320), rel=0.2)


def test_bootstrap_is_seeded_and_checks_its_input():
    x = [0.1, 0.5, 0.2, 0.9]
    assert bootstrap_ci(x) == bootstrap_ci(x)
    assert bootstrap_ci([]) is None
    assert bootstrap_ci([1.0, 1.0, 1.0]) == (1.0, 1.0)
    with pytest.raises(ValueError, match="differ in length"):
        bootstrap_ci([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="level"):
        bootstrap_ci([1.0], level=1.5)


def record(agrees, accuracy, kls, stop="reflect_right"):
    """A question record with forced turns of (first_kl, mean_kl, tokens)."""
    forced = [{"first_kl": f, "mean_kl": m, "tokens": t} for f, m, t in kls]
    return {"agrees": agrees, "accuracy": accuracy, "forced": forced, "stop_reason": stop}


def test_kl_intervals_pool_turns_and_tokens_by_question():
    """Every question identical: the interval collapses onto the pooled value."""
    recs = [record(True, 1.0, [(0.2, 0.1, 10), (0.4, 0.4, 30)])] * 5
    iv = method_intervals(recs, ["accuracy"])
    assert iv["first_kl"] == pytest.approx([0.3, 0.3])
    assert iv["mean_kl"] == pytest.approx([(0.1 * 10 + 0.4 * 30) / 40] * 2)
    assert iv["agreement"] == [1.0, 1.0]


def test_uncertainty_stop_reasons_and_conclusion():
    ref = [record(True, float(i % 2), [(0.0, 0.0, 5)]) for i in range(20)]
    same = [record(True, float(i % 2), [(0.1, 0.1, 5)]) for i in range(20)]
    worse = [
        record(i < 4, 0.0, [(0.9, 0.5, 5)], "step_limit" if i < 15 else "reflect_right") for i in range(20)
    ]
    per_question = [
        {"methods": {"nonshared": r, "good": s, "bad": w}} for r, s, w in zip(ref, same, worse, strict=True)
    ]
    unc = uncertainty(per_question, ["nonshared", "good", "bad"], ["accuracy"])
    assert stop_reasons(worse) == {"step_limit": 15, "reflect_right": 5}
    assert unc["methods"]["bad"]["stop_reasons"] == {"step_limit": 15, "reflect_right": 5}
    good, bad = (unc["methods"][m]["against_reference"]["accuracy"] for m in ("good", "bad"))
    assert good["p"] == 1.0 and good["diff"] == 0.0
    assert (bad["better"], bad["worse"]) == (0, 10) and bad["p"] == pytest.approx(2 / 1024)
    assert unc["agreement_pairs"]["best"] == "good"
    lines = conclusion(unc, ["accuracy"])
    assert "inside noise for good (+0.000, p = 1)" in lines[0] and "separated for bad" in lines[0]
    assert "separated from bad" in lines[1]
    table = {m: {"agreement": 1.0, "accuracy": 0.5, "first_kl": 0.1, "mean_kl": 0.1} for m in unc["methods"]}
    text = "\n".join(uncertainty_markdown({"uncertainty": unc, "metrics": ["accuracy"], "table": table}))
    assert "step_limit 15, reflect_right 5" in text and "p = 0.002" in text
