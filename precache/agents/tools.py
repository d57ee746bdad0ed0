"""Offline tools over one question's own paragraphs: ``Retrieve``, ``Lookup``, ``Finish``.

Everything runs locally on the question's 10 HotpotQA paragraphs; nothing is fetched. A
malformed or unknown action never raises: it yields an error observation, so the agents can
recover on the next step.

Observation cap: ``Retrieve`` shows the first ``MAX_SENTENCES`` (3) sentences of the paragraph,
cut to ``MAX_WORDS`` (80) words with a trailing ``...``, so that a trajectory with two
retrievals stays around 400 tokens. ``Lookup`` searches every sentence of the paragraph, the
ones beyond the cap included.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
from dataclasses import dataclass

from precache.agents.data import Question

ACTION_TYPES = ("Retrieve", "Lookup", "Finish")
MAX_SENTENCES = 3
MAX_WORDS = 80
NEAR_TITLE_RATIO = 0.8

_ACTION_RE = re.compile(r"^\s*(\w+)\s*\[(.*)\]\s*$", re.DOTALL)
_PARENTHETICAL_RE = re.compile(r"\s*\([^)]*\)")
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)


def _bm25s():
    """bm25s, imported when a HotpotQA tool environment is built (the core and the CLI's parser do
    not need it). It pins its logger to DEBUG at import and logs every index build: keep warnings."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s


@dataclass(frozen=True)
class StepResult:
    """What one action did: the observation text, and the answer when it was ``Finish``."""

    observation: str
    done: bool = False
    answer: str | None = None
    error: bool = False


def cap_paragraph(sentences: tuple[str, ...] | list[str]) -> str:
    """First ``MAX_SENTENCES`` sentences joined, cut to ``MAX_WORDS`` words (then ``...``)."""
    words = "".join(sentences[:MAX_SENTENCES]).split()
    text = " ".join(words[:MAX_WORDS])
    return text + " ..." if len(words) > MAX_WORDS else text


def parse_action(text: str) -> tuple[str, str] | None:
    """``"Retrieve[Badr Hari]"`` -> ``("Retrieve", "Badr Hari")``; None if not ``Type[arg]``."""
    match = _ACTION_RE.match(text)
    if match is None:
        return None
    return match.group(1), match.group(2).strip()


def normalize_title(text: str) -> str:
    """Lower-case, punctuation removed, whitespace collapsed: ``" Badr  Hari."`` -> ``"badr hari"``."""
    return " ".join(text.lower().translate(_PUNCT_TABLE).split())


class ToolEnv:
    """The tools over one question's paragraphs, with the ``Lookup`` cursor state.

    ``step("Retrieve[entity]")`` returns a :class:`StepResult`; it never raises on bad input.
    """

    def __init__(self, question: Question) -> None:
        self.question = question
        self._paragraphs = {title: sentences for title, sentences in question.context}
        self._titles = list(self._paragraphs)
        corpus = [f"{title}. {''.join(sentences)}" for title, sentences in question.context]
        bm25s = _bm25s()
        self._bm25 = bm25s.BM25()
        self._bm25.index(bm25s.tokenize(corpus, show_progress=False), show_progress=False)
        self.current_title: str | None = None
        self._lookup_keyword: str | None = None
        self._lookup_hits: list[str] = []
        self._lookup_next = 0

    def step(self, action: str) -> StepResult:
        """Run one action written as ``Type[argument]``."""
        parsed = parse_action(action)
        if parsed is None:
            return StepResult(
                f"Invalid action {action.strip()!r}. Write Retrieve[entity], Lookup[keyword] or "
                "Finish[answer].",
                error=True,
            )
        kind, argument = parsed
        if kind not in ACTION_TYPES:
            return StepResult(
                f"Unknown action {kind}. Use Retrieve[entity], Lookup[keyword] or Finish[answer].",
                error=True,
            )
        if not argument:
            return StepResult(f"{kind} needs an argument inside the brackets.", error=True)
        if kind == "Finish":
            return StepResult(f"Finished with answer: {argument}", done=True, answer=argument)
        if kind == "Retrieve":
            return self.retrieve(argument)
        return self.lookup(argument)

    def find_title(self, entity: str) -> str | None:
        """Best paragraph title for ``entity``.

        Order: exact title after normalisation (case, punctuation, spaces); the same with
        parentheticals removed (``"Hari (boxer)"``); the closest title by difflib ratio
        >= ``NEAR_TITLE_RATIO``; else BM25 over title + text. None when nothing matches.
        """
        target = normalize_title(entity)
        normalised = {title: normalize_title(title) for title in self._titles}
        for title, norm in normalised.items():
            if norm == target:
                return title
        bare_target = normalize_title(_PARENTHETICAL_RE.sub("", entity))
        for title in self._titles:
            if normalize_title(_PARENTHETICAL_RE.sub("", title)) == bare_target:
                return title
        ratios = {t: difflib.SequenceMatcher(None, n, target).ratio() for t, n in normalised.items()}
        best = max(ratios, key=ratios.get)
        if ratios[best] >= NEAR_TITLE_RATIO:
            return best
        return self._bm25_title(entity)

    def _bm25_title(self, query: str) -> str | None:
        tokens = _bm25s().tokenize([query], show_progress=False)
        if not tokens.ids or not tokens.ids[0]:
            return None  # only stopwords or punctuation
        docs, scores = self._bm25.retrieve(tokens, k=1, show_progress=False)
        if float(scores[0, 0]) <= 0.0:
            return None
        return self._titles[int(docs[0, 0])]

    def retrieve(self, entity: str) -> StepResult:
        """The capped text of the best paragraph for ``entity``; resets the Lookup cursor."""
        title = self.find_title(entity)
        if title is None:
            return StepResult(f"No paragraph found for {entity}. Try another entity.")
        self.current_title = title
        self._lookup_keyword = None
        return StepResult(cap_paragraph(self._paragraphs[title]))

    def lookup(self, keyword: str) -> StepResult:
        """Next sentence of the last retrieved paragraph containing ``keyword`` (case-insensitive).

        Repeating the same keyword advances the cursor; a new keyword starts from the top.
        """
        if self.current_title is None:
            return StepResult("No paragraph retrieved yet. Use Retrieve[entity] first.")
        if keyword != self._lookup_keyword:
            needle = keyword.lower()
            sentences = self._paragraphs[self.current_title]
            self._lookup_hits = [s.strip() for s in sentences if needle in s.lower()]
            self._lookup_keyword = keyword
            self._lookup_next = 0
        if not self._lookup_hits:
            return StepResult(f"No sentence in {self.current_title} contains {keyword}.")
        if self._lookup_next >= len(self._lookup_hits):
            return StepResult(f"No more results for {keyword} in {self.current_title}.")
        index = self._lookup_next
        self._lookup_next += 1
        return StepResult(f"(Result {index + 1} / {len(self._lookup_hits)}) {self._lookup_hits[index]}")
