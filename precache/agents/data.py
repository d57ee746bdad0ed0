"""HotpotQA questions (distractor setting) for the plan / action / reflect agents.

The data folder is the package's ``precache/assets/`` (package data, found from an installed
package too), or ``$PRECACHE_DATA`` when set. It holds ``hotpotqa/{easy,medium}.jsonl`` and the
fixed train / dev split ``hotpotqa/split.json`` (see ``precache/assets/hotpotqa/README.md``).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from precache.errors import PrecacheError

#: fields of a HotpotQA record (``_id`` is the original dataset's spelling of ``id``)
RECORD_FIELDS = ("id", "_id", "question", "answer", "context", "supporting_facts", "type", "level")
LEVELS = ("easy", "medium")
SPLITS = ("train", "dev", "all")
SPLIT_SEED = 2018
DEV_PER_LEVEL = 30


class DatasetError(PrecacheError):
    """The HotpotQA files are missing, or a question id / split name is unknown."""


@dataclass(frozen=True)
class Question:
    """One HotpotQA question with its own 10 paragraphs (2 or 6 for three easy questions).

    ``supporting_facts`` holds ``(title, sentence_index)`` pairs; ``context`` holds
    ``(title, sentences)`` pairs, sentences as in the source (later ones start with a space).
    """

    id: str
    question: str
    answer: str
    type: str
    level: str
    supporting_facts: tuple[tuple[str, int], ...]
    context: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def titles(self) -> list[str]:
        """Paragraph titles in context order."""
        return [title for title, _ in self.context]

    @property
    def supporting_titles(self) -> list[str]:
        """Titles of the gold paragraphs, in order of first mention in ``supporting_facts``."""
        return list(dict.fromkeys(title for title, _ in self.supporting_facts))

    @classmethod
    def from_json(cls, row: dict) -> Question:
        """Build from one line of the jsonl files (lists become tuples)."""
        return cls(
            id=row["id"],
            question=row["question"],
            answer=row["answer"],
            type=row["type"],
            level=row["level"],
            supporting_facts=tuple((title, int(idx)) for title, idx in row["supporting_facts"]),
            context=tuple((title, tuple(sentences)) for title, sentences in row["context"]),
        )


def data_dir() -> Path:
    """The data folder: ``$PRECACHE_DATA`` or the package's ``precache/assets/``."""
    env = os.environ.get("PRECACHE_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "assets"


def dataset_dir(name: str, label: str, files: list[str]) -> Path:
    """``<data>/<name>`` (:func:`data_dir`), the folder of the dataset called ``label`` in messages.

    Raises:
        DatasetError: one of ``files`` is not there; the message names them all and
            ``PRECACHE_DATA``.
    """
    folder = data_dir() / name
    if not all((folder / f).is_file() for f in files):
        raise DatasetError(
            f"{label} files {', '.join(files)} not found under {folder} "
            f"(set PRECACHE_DATA to the folder that holds {name}/)"
        )
    return folder


def hotpotqa_dir() -> Path:
    """``<data>/hotpotqa``. Raises DatasetError if it has no question files."""
    return dataset_dir("hotpotqa", "HotpotQA", [f"{level}.jsonl" for level in LEVELS])


@lru_cache(maxsize=4)
def _load_all(folder: Path) -> tuple[Question, ...]:
    questions = []
    for level in LEVELS:
        with open(folder / f"{level}.jsonl", encoding="utf-8") as fh:
            questions.extend(Question.from_json(json.loads(line)) for line in fh if line.strip())
    return tuple(questions)


def make_split(questions: list[Question], seed: int = SPLIT_SEED, dev_per_level: int = DEV_PER_LEVEL) -> dict:
    """Deterministic train / dev split, stratified by level.

    Within each level, ids are sorted, shuffled with ``random.Random(seed)`` and the first
    ``dev_per_level`` go to dev. Returns ``{"train": [ids], "dev": [ids]}`` in file order.
    """
    return stratified_split(questions, lambda q: q.level, LEVELS, seed, dev_per_level)


def stratified_split(questions: list, group_of, groups, seed: int, dev_per_group: int) -> dict:
    """``{"train": [ids], "dev": [ids]}`` in file order: within each of ``groups`` (in order), the
    ids of the questions with ``group_of(q) == group`` are sorted, shuffled with one
    ``random.Random(seed)`` and the first ``dev_per_group`` go to dev (HotpotQA by level,
    ScienceQA by grade band)."""
    rng = random.Random(seed)
    dev: set[str] = set()
    for group in groups:
        ids = sorted(q.id for q in questions if group_of(q) == group)
        rng.shuffle(ids)
        dev.update(ids[:dev_per_group])
    return {
        "train": [q.id for q in questions if q.id not in dev],
        "dev": [q.id for q in questions if q.id in dev],
    }


def select_split(questions: list, split: str, folder: Path, make) -> list:
    """The questions of ``split`` (``"all"``: every one): ids from ``folder/split.json`` when it is
    there, else from ``make(questions)``."""
    if split == "all":
        return questions
    split_file = folder / "split.json"
    if split_file.is_file():
        ids = set(json.loads(split_file.read_text(encoding="utf-8"))[split])
    else:
        ids = set(make(questions)[split])
    return [q for q in questions if q.id in ids]


def load_questions(split: str = "dev") -> list[Question]:
    """Questions of one split (``"train"``, ``"dev"`` or ``"all"``), in file order.

    Raises:
        DatasetError: unknown split, or missing files.
    """
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    folder = hotpotqa_dir()
    return select_split(list(_load_all(folder)), split, folder, make_split)


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def parse_context(value, where: str, add_spaces: bool = False) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Check paragraphs in HotpotQA's shape, ``[[title, [sentence, ...]], ...]``, and return them
    as tuples. HotpotQA's sentences carry their own separators (a later sentence starts with a
    space) and are joined with ``""``, by the tools too; ``add_spaces`` reads plain sentences
    instead: a space goes before each later sentence that neither starts with one nor follows one.

    ``where`` starts each error message (a file name, ``FILE line N``).

    Raises:
        DatasetError: not a non-empty list of pairs, a title that is not a non-empty string or
            repeats, or sentences that are not a non-empty list of strings; the message names the
            field (``context[2][1]``).
    """
    if not isinstance(value, list) or not value:
        raise DatasetError(
            f"{where}: field 'context' must be a non-empty list of [title, [sentence, ...]] pairs, "
            f"got {_kind(value)}"
        )
    seen: set[str] = set()
    paragraphs = []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise DatasetError(f"{where}: field 'context[{i}]' must be a [title, [sentence, ...]] pair")
        title, sentences = pair
        if not isinstance(title, str) or not title.strip():
            raise DatasetError(f"{where}: field 'context[{i}][0]' (title) must be a non-empty string")
        if title in seen:
            raise DatasetError(f"{where}: field 'context[{i}][0]': title {title!r} appears twice")
        seen.add(title)
        if not isinstance(sentences, list) or not sentences or not all(isinstance(x, str) for x in sentences):
            raise DatasetError(
                f"{where}: field 'context[{i}][1]' must be a non-empty list of sentence strings, "
                f"got {_kind(sentences)}"
            )
        spaced = [sentences[0]]
        for sentence in sentences[1:]:
            joined = not add_spaces or spaced[-1][-1:].isspace() or sentence[:1].isspace()
            spaced.append(sentence if joined else " " + sentence)
        paragraphs.append((title, tuple(spaced)))
    return tuple(paragraphs)


def _text_field(row: dict, name: str, where: str, required: bool = True) -> str:
    value = row.get(name, None if required else "")
    if not isinstance(value, str) or (required and not value.strip()):
        raise DatasetError(f"{where}: field '{name}' must be a non-empty string, got {_kind(value)}")
    return value


def parse_record(row, where: str) -> Question:
    """A :class:`Question` from one HotpotQA record, checked field by field: ``id`` (or ``_id``),
    ``question`` and ``answer`` non-empty strings, ``context`` as :func:`parse_context` (sentences
    kept as given, HotpotQA's own text),
    optional ``supporting_facts`` (``[[title, sentence_index], ...]``), ``type`` and ``level``.

    Raises:
        DatasetError: a field is missing, of the wrong type, or not a HotpotQA field; the message
            starts with ``where`` and names the field.
    """
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a record must be a JSON object, got {_kind(row)}")
    unknown = [k for k in row if k not in RECORD_FIELDS]
    if unknown:
        raise DatasetError(
            f"{where}: field(s) {', '.join(map(repr, unknown))} are not HotpotQA fields "
            f"(fields: {', '.join(RECORD_FIELDS)})"
        )
    if "id" in row and "_id" in row and row["id"] != row["_id"]:
        raise DatasetError(f"{where}: fields 'id' and '_id' differ")
    ident = _text_field({"id": row.get("id", row.get("_id"))}, "id", where)
    facts = row.get("supporting_facts", [])
    if not isinstance(facts, list) or not all(
        isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and isinstance(f[1], int) and f[1] >= 0
        for f in facts
    ):
        raise DatasetError(
            f"{where}: field 'supporting_facts' must be a list of [title, sentence_index] pairs"
        )
    return Question(
        id=ident,
        question=_text_field(row, "question", where),
        answer=_text_field(row, "answer", where),
        type=_text_field(row, "type", where, required=False),
        level=_text_field(row, "level", where, required=False),
        supporting_facts=tuple((title, idx) for title, idx in facts),
        context=parse_context(row.get("context"), where),
    )


def load_question_file(path: str | os.PathLike) -> list[Question]:
    """Questions of your own in the HotpotQA format, in file order: a ``.jsonl`` file (one record a
    line, blank lines skipped) or a JSON list of records (HotpotQA's own ``*.json`` files). Each
    record is checked by :func:`parse_record`.

    Raises:
        DatasetError: the file is missing or empty, a line is not JSON, a record is malformed, or
            an id repeats; the message names the file, the line (or record) and the field.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"no question file {path}")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            rows = [(f"{path} record {i}", row) for i, row in enumerate(json.loads(text))]
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: not a JSON list of records ({exc})") from None
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"{path} line {number}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path} line {number}: not a JSON object ({exc.msg})") from None
    questions: list[Question] = []
    first: dict[str, str] = {}
    for where, row in rows:
        question = parse_record(row, where)
        if question.id in first:
            raise DatasetError(f"{where}: field 'id': {question.id!r} repeats ({first[question.id]})")
        first[question.id] = where
        questions.append(question)
    if not questions:
        raise DatasetError(f"no questions in {path}")
    return questions


def get_question(question_id: str) -> Question:
    """The question with this id. Raises DatasetError if no question has it."""
    for question in _load_all(hotpotqa_dir()):
        if question.id == question_id:
            return question
    raise DatasetError(f"no HotpotQA question with id {question_id!r} under {hotpotqa_dir()}")
