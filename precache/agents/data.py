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


def hotpotqa_dir() -> Path:
    """``<data>/hotpotqa``. Raises DatasetError if it has no question files."""
    folder = data_dir() / "hotpotqa"
    if not all((folder / f"{level}.jsonl").is_file() for level in LEVELS):
        raise DatasetError(
            f"HotpotQA files {', '.join(f'{lv}.jsonl' for lv in LEVELS)} not found under {folder} "
            "(set PRECACHE_DATA to the folder that holds hotpotqa/)"
        )
    return folder


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
    rng = random.Random(seed)
    dev: set[str] = set()
    for level in LEVELS:
        ids = sorted(q.id for q in questions if q.level == level)
        rng.shuffle(ids)
        dev.update(ids[:dev_per_level])
    return {
        "train": [q.id for q in questions if q.id not in dev],
        "dev": [q.id for q in questions if q.id in dev],
    }


def load_questions(split: str = "dev") -> list[Question]:
    """Questions of one split (``"train"``, ``"dev"`` or ``"all"``), in file order.

    Raises:
        DatasetError: unknown split, or missing files.
    """
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    folder = hotpotqa_dir()
    questions = list(_load_all(folder))
    if split == "all":
        return questions
    split_file = folder / "split.json"
    if split_file.is_file():
        ids = set(json.loads(split_file.read_text(encoding="utf-8"))[split])
    else:
        ids = set(make_split(questions)[split])
    return [q for q in questions if q.id in ids]


def get_question(question_id: str) -> Question:
    """The question with this id. Raises DatasetError if no question has it."""
    for question in _load_all(hotpotqa_dir()):
        if question.id == question_id:
            return question
    raise DatasetError(f"no HotpotQA question with id {question_id!r} under {hotpotqa_dir()}")
