"""HotpotQA loading and the fixed train / dev split."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from precache.agents import data
from precache.agents.data import DatasetError, get_question, load_questions, make_split


def test_split_sizes_and_stratification():
    train, dev = load_questions("train"), load_questions("dev")
    assert len(train) == 140 and len(dev) == 60
    assert not {q.id for q in train} & {q.id for q in dev}
    assert Counter(q.level for q in dev) == {"easy": 30, "medium": 30}
    assert len(load_questions("all")) == 200


def test_split_file_matches_the_seeded_rule():
    on_disk = json.loads((data.hotpotqa_dir() / "split.json").read_text())
    assert on_disk == make_split(load_questions("all"))


def test_question_fields():
    q = get_question("5a832c3455429954d2e2ec41")
    assert q.answer == "Badr Hari" and q.type == "bridge" and q.level == "easy"
    assert q.supporting_titles == ["Global Fighting Championship", "Badr Hari"]
    assert q.supporting_facts[0] == ("Global Fighting Championship", 1)
    assert len(q.context) == 10 and q.titles[4] == "Badr Hari" and len(q.context[4][1]) == 3


def test_errors(monkeypatch, tmp_path):
    with pytest.raises(DatasetError, match="no HotpotQA question"):
        get_question("nope")
    with pytest.raises(DatasetError, match="unknown split"):
        load_questions("test")
    monkeypatch.setenv("PRECACHE_DATA", str(tmp_path))
    with pytest.raises(DatasetError, match="PRECACHE_DATA"):
        load_questions("all")
