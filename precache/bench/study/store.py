"""Where ``precache study`` (:mod:`precache.bench.study`) keeps its results: one point (benchmark x
adapter set x adapter scale) per folder, one gzipped JSON file per question, and the settings the
questions were run with, so a study that stops resumes and a finished one only rebuilds its report.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

import torch

from precache.errors import PrecacheError

SIGNIFICANT = 6  # digits a stored float keeps

#: the revision of each method's stored rows (1 when not listed): a row stored under an older one
#: is run again, the other methods' rows are kept. 2: the selective-recompute baselines keep each
#: agent's view across its turns (issue 23).
METHOD_REVISIONS = {"cacheblend": 2, "droidspeak": 2, "relaycaching": 2}


def revision(method: str) -> int:
    """The current revision of ``method``'s stored rows (:data:`METHOD_REVISIONS`)."""
    return METHOD_REVISIONS.get(method, 1)


def stale(entry: dict | None, methods: list[str]) -> list[str]:
    """The ``methods`` a stored question ``entry`` lacks, or holds at an older revision (all of them
    when nothing is stored), in order."""
    if entry is None:
        return list(methods)
    rows = entry["methods"]
    return [m for m in methods if m not in rows or rows[m].get("revision", 1) < revision(m)]


def _rounded(value):
    """``value`` (JSON-ready) with every float kept to :data:`SIGNIFICANT` significant digits."""
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT}g}")
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def adapters_fingerprint(adapters: dict) -> str:
    """The first 16 hex digits of a sha256 over every role's LoRA weights as loaded (role names,
    scaling, each module's A, B and bias in fp32): a stored point run with other adapter weights
    (retrained, or stored in another dtype) does not match, whatever the folder is called."""
    digest = hashlib.sha256()
    for role in sorted(adapters):
        adapter = adapters[role]
        digest.update(f"{role}:{adapter.scaling!r}".encode())
        for key in sorted(adapter.weights):
            tensors = [*adapter.weights[key], *([adapter.biases[key]] if key in adapter.biases else [])]
            digest.update(repr(key).encode())
            for t in tensors:
                digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class StoredResultsError(PrecacheError):
    """A study's ``--out`` folder holds questions run with other settings."""


class PointStore:
    """One point of the study (benchmark x adapter set x adapter scale) on disk, one gzipped JSON
    file per question under ``folder`` (``<question id>.json.gz``, floats kept to
    :data:`SIGNIFICANT` significant digits) plus ``point.json`` (the settings its questions were
    run with), so a study that stops resumes where it stopped and two processes can fill different
    points of one ``--out`` folder. Methods may be added to a stored point (``point.json`` then lists
    the union): only the methods a question lacks, or holds at an older revision
    (:data:`METHOD_REVISIONS`), run again (:meth:`lacking`).

    Raises:
        StoredResultsError: ``folder`` holds questions run with other settings than ``methods``
            (it names both).
    """

    def __init__(self, folder: Path, settings: dict):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.methods = list(settings.get("methods") or [])
        meta = self.folder / "point.json"
        if not meta.is_file():
            meta.write_text(json.dumps(settings, indent=1) + "\n")
            return
        stored = json.loads(meta.read_text())
        if {k: v for k, v in stored.items() if k != "methods"} != {
            k: v for k, v in settings.items() if k != "methods"
        }:
            differ = ", ".join(
                f"{key} {stored.get(key)!r} there, {settings.get(key)!r} now"
                for key in sorted(set(stored) | set(settings), key=str)
                if stored.get(key) != settings.get(key) and key != "methods"
            )
            raise StoredResultsError(
                f"{self.folder} holds questions run with other settings ({differ}): pass the settings "
                "they were run with (--max-steps, --max-new-tokens, --model, the same adapter weights), "
                "or use another --out"
            )
        union = [*stored.get("methods", []), *(m for m in self.methods if m not in stored.get("methods", []))]
        if union != stored.get("methods"):  # methods added to the point: the stored rows are kept
            meta.write_text(json.dumps({**stored, "methods": union}, indent=1) + "\n")

    def _path(self, question_id: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9_.-]", "_", str(question_id)) + ".json.gz")

    def missing(self, questions: list) -> list:
        """The questions with no stored result, in order."""
        return [q for q in questions if not self._path(q.id).is_file()]

    def entry(self, question) -> dict | None:
        """The stored entry of ``question``, or None."""
        path = self._path(question.id)
        return json.loads(gzip.decompress(path.read_bytes())) if path.is_file() else None

    def lacking(self, questions: list) -> list[tuple[object, list[str]]]:
        """``(question, methods)`` for each question with methods of this point to run: not
        stored, or stored at an older revision (:func:`stale`), in order."""
        out = []
        for q in questions:
            need = stale(self.entry(q), self.methods)
            if need:
                out.append((q, need))
        return out

    def stored(self, questions: list) -> list:
        """The questions with a stored result, in order."""
        return [q for q in questions if self._path(q.id).is_file()]

    def save(self, entry: dict) -> None:
        """Store one question's entry (written to a temporary file, then renamed)."""
        path = self._path(entry["id"])
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(gzip.compress(json.dumps(_rounded(entry), separators=(",", ":")).encode(), mtime=0))
        tmp.replace(path)

    def load(self, questions: list) -> list[dict]:
        """The stored entries of ``questions``, in order."""
        return [json.loads(gzip.decompress(self._path(q.id).read_bytes())) for q in questions]
