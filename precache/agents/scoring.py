"""Answer scoring: exact match and token F1 with the SQuAD / HotpotQA normalisation.

Normalisation (Rajpurkar et al., 2016; kept by Yang et al., 2018): lower-case, drop
punctuation, drop the articles a / an / the, collapse whitespace. F1 follows the official
HotpotQA evaluation: when either normalised answer is ``yes``, ``no`` or ``noanswer`` and the two
differ, F1 is 0 (no partial credit for a token overlap with those special answers).
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)
_SPECIAL_ANSWERS = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """Lower-case, strip punctuation, remove articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str) -> float:
    """Token F1 between the normalised answers, in [0, 1] (HotpotQA special cases, see module)."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in _SPECIAL_ANSWERS or ref in _SPECIAL_ANSWERS) and pred != ref:
        return 0.0
    common = Counter(pred.split()) & Counter(ref.split())
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred.split())
    recall = overlap / len(ref.split())
    return 2 * precision * recall / (precision + recall)
