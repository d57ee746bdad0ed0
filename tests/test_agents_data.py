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


def test_every_command_with_questions_takes_the_same_split_choices(capsys):
    """``--split`` (spelled in precache.cli_args so the parser needs no torch) offers exactly the
    splits ``load_questions`` knows, with its help text, in every command that runs questions."""
    from precache.cli import build_parser
    from precache.cli_args import SPLITS

    assert set(SPLITS) == set(data.SPLITS)
    parser = build_parser()
    for command in (["eval"], ["fidelity"], ["bench", "episodes"], ["study"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--help"])
        out = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal's width
        assert "--split {dev,train,all}" in out and "dev (held out; default)" in out, command
