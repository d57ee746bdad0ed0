"""ScienceQA questions (AutoAct's text form) for the plan / action / reflect agents.

240 multiple-choice questions (Lu et al., NeurIPS 2022, "Learn to Explain"), 120 from grades 1-4
(``grade1-4.json``) and 120 from grades 5-8 (``grade5-8.json``), under ``<data>/scienceqa/``
(the package's ``precache/assets/`` or ``$PRECACHE_DATA``), licensed CC BY-NC-SA 4.0 (see
``precache/assets/scienceqa/README.md``). Images are given as a caption and OCR text.

Scoring is option accuracy: the chosen letter equals ``Answer``; :func:`parse_option` reads the
agent's ``Finish`` argument (``B``, ``(B)``, ``B) text`` or the option's own text).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from precache.agents.data import SPLITS, DatasetError, dataset_dir, select_split, stratified_split
from precache.agents.scoring import normalize_answer

#: the grade bands, one file each, in load order
BANDS = ("grade1-4", "grade5-8")
RECORD_FIELDS = ("Question", "choices", "Answer", "caption", "orc", "metadata", "pid")
METADATA_FIELDS = ("has_image", "grade", "subject", "topic", "category", "skill")
NO_IMAGE = "no img"
LETTERS = "ABCDEFGHIJ"
SPLIT_SEED = 2022
DEV_PER_BAND = 30

_LETTER_RE = re.compile(r"^\(?\s*([A-J])\s*(?:\)|\.|:|$)")
_OPTION_WORD_RE = re.compile(r"^(?:option|answer)\s*:?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class ScienceQuestion:
    """One ScienceQA question: ``question`` holds the text and its ``Options: (A) ...`` line;
    ``caption`` and ``ocr`` are None when the question has no image; ``ocr`` is the detected
    words joined by spaces ("" when the image has none)."""

    id: str
    question: str
    choices: tuple[str, ...]
    answer: str
    caption: str | None
    ocr: str | None
    grade: int
    band: str
    subject: str
    topic: str
    category: str
    skill: str

    @property
    def has_image(self) -> bool:
        """Whether the question comes with an image (caption and OCR text)."""
        return self.caption is not None

    @property
    def letters(self) -> str:
        """The option letters, ``"AB"`` to ``"ABCDE"``."""
        return LETTERS[: len(self.choices)]

    @property
    def answer_text(self) -> str:
        """The text of the gold option."""
        return self.choices[LETTERS.index(self.answer)]


def ocr_words(value: str) -> str:
    """The OCR words of an AutoAct ``orc`` field (Python repr of ``[(box, word, confidence), ...]``),
    each stripped, blank ones dropped, joined by spaces in the given order; ``"[]"`` -> ``""``.

    Raises:
        ValueError: not such a list.
    """
    detections = ast.literal_eval(value)
    if not isinstance(detections, list) or not all(
        isinstance(d, tuple | list) and len(d) == 3 and isinstance(d[1], str) for d in detections
    ):
        raise ValueError("not a list of (box, word, confidence) triples")
    return " ".join(d[1].strip() for d in detections if d[1].strip())


def _field(row: dict, name: str, kind: type, where: str):
    value = row.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) is not (kind is bool):
        got = "missing" if name not in row else type(value).__name__
        raise DatasetError(f"{where}: field '{name}' must be {kind.__name__}, got {got}")
    return value


def parse_record(row, where: str, band: str) -> ScienceQuestion:
    """A :class:`ScienceQuestion` from one AutoAct record, checked field by field.

    Raises:
        DatasetError: a field is missing, unknown or of the wrong type; fewer than 2 or more than
            10 choices; ``Answer`` not one of the option letters; ``Question`` without the
            ``Options:`` line; ``caption`` / ``orc`` disagreeing with ``metadata.has_image``; the
            message starts with ``where`` and names the field.
    """
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
    unknown = [k for k in row if k not in RECORD_FIELDS]
    if unknown:
        raise DatasetError(f"{where}: field(s) {', '.join(map(repr, unknown))} are not ScienceQA fields")
    question = _field(row, "Question", str, where)
    choices = _field(row, "choices", list, where)
    if not 2 <= len(choices) <= len(LETTERS) or not all(isinstance(c, str) and c for c in choices):
        raise DatasetError(f"{where}: field 'choices' must hold 2 to {len(LETTERS)} non-empty strings")
    answer = _field(row, "Answer", str, where)
    if answer not in LETTERS[: len(choices)]:
        raise DatasetError(
            f"{where}: field 'Answer' must be one of {LETTERS[: len(choices)]}, got {answer!r}"
        )
    if "\nOptions: (A) " not in question:
        raise DatasetError(f"{where}: field 'Question' has no '\\nOptions: (A) ...' line")
    meta = _field(row, "metadata", dict, where)
    values = {name: _field(meta, name, str, f"{where}: metadata") for name in METADATA_FIELDS[2:]}
    has_image = _field(meta, "has_image", bool, f"{where}: metadata")
    grade = _field(meta, "grade", int, f"{where}: metadata")
    caption, orc = _field(row, "caption", str, where), _field(row, "orc", str, where)
    if (caption == NO_IMAGE) is has_image or (orc == NO_IMAGE) is has_image:
        raise DatasetError(f"{where}: fields 'caption' / 'orc' disagree with 'metadata.has_image'")
    try:
        ocr = None if orc == NO_IMAGE else ocr_words(orc)
    except (ValueError, SyntaxError) as exc:
        raise DatasetError(f"{where}: field 'orc' is not an OCR list ({exc})") from None
    return ScienceQuestion(
        id=_field(row, "pid", str, where),
        question=question,
        choices=tuple(choices),
        answer=answer,
        caption=None if caption == NO_IMAGE else caption,
        ocr=ocr,
        grade=grade,
        band=band,
        **values,
    )


def scienceqa_dir() -> Path:
    """``<data>/scienceqa``. Raises DatasetError if it lacks one of the two question files."""
    return dataset_dir("scienceqa", "ScienceQA", [f"{band}.json" for band in BANDS])


def load_file(path: Path, band: str) -> list[ScienceQuestion]:
    """The questions of one AutoAct JSON list, checked by :func:`parse_record`; ids must not repeat.

    Raises:
        DatasetError: not a JSON list, a malformed record, or a repeated ``pid``.
    """
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not JSON ({exc})") from None
    if not isinstance(rows, list):
        raise DatasetError(f"{path}: must be a JSON list of records")
    questions = [parse_record(row, f"{path} record {i}", band) for i, row in enumerate(rows)]
    seen: set[str] = set()
    for i, q in enumerate(questions):
        if q.id in seen:
            raise DatasetError(f"{path} record {i}: field 'pid': {q.id!r} repeats")
        seen.add(q.id)
    return questions


@lru_cache(maxsize=4)
def _load_all(folder: Path) -> tuple[ScienceQuestion, ...]:
    return tuple(q for band in BANDS for q in load_file(folder / f"{band}.json", band))


def make_split(
    questions: list[ScienceQuestion], seed: int = SPLIT_SEED, dev_per_band: int = DEV_PER_BAND
) -> dict:
    """Deterministic train / dev split, stratified by grade band.

    Within each band (grade1-4 first), ids are sorted, shuffled with one ``random.Random(seed)``
    and the first ``dev_per_band`` go to dev. Returns ``{"train": [ids], "dev": [ids]}`` in file
    order.
    """
    return stratified_split(questions, lambda q: q.band, BANDS, seed, dev_per_band)


def load_questions(split: str = "dev") -> list[ScienceQuestion]:
    """Questions of one split (``"train"``, ``"dev"`` or ``"all"``), in file order.

    Raises:
        DatasetError: unknown split, or missing / malformed files.
    """
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    folder = scienceqa_dir()
    return select_split(list(_load_all(folder)), split, folder, make_split)


def get_question(question_id: str) -> ScienceQuestion:
    """The question with this ``pid``. Raises DatasetError if no question has it."""
    for question in _load_all(scienceqa_dir()):
        if question.id == question_id:
            return question
    raise DatasetError(f"no ScienceQA question with pid {question_id!r} under {scienceqa_dir()}")


def parse_option(text: str, question: ScienceQuestion) -> str | None:
    """The option letter an answer names, or None.

    Accepted: a letter (``B``), in parentheses or followed by ``)`` / ``.`` / ``:`` and more text
    (``(B)``, ``B) Dover``), after ``option`` / ``answer``; else the option's own text, equal
    after answer normalisation (:func:`~precache.agents.scoring.normalize_answer`). A letter
    beyond the question's options is None.
    """
    stripped = _OPTION_WORD_RE.sub("", text.strip())
    match = _LETTER_RE.match(stripped)
    if match is not None:
        return match.group(1) if match.group(1) in question.letters else None
    target = normalize_answer(stripped)
    hits = [
        letter
        for letter, choice in zip(question.letters, question.choices, strict=True)
        if normalize_answer(choice) == target
    ]
    return hits[0] if len(hits) == 1 else None


def option_accuracy(prediction: str, question: ScienceQuestion) -> float:
    """1.0 when :func:`parse_option` reads the gold letter from ``prediction``, else 0.0."""
    return float(parse_option(prediction, question) == question.answer)
