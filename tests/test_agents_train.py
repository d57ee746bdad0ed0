"""Gold trajectories and their per-role token masks (tokenizer only, no model forward)."""

from __future__ import annotations

import random

import pytest

from precache.agents import prompt
from precache.agents.data import get_question, load_questions
from precache.agents.gold import gold_trajectories, gold_trajectory, wrong_answer
from precache.agents.train import IGNORE_INDEX, tokenize_pieces

QID = "5a832c3455429954d2e2ec41"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from precache.models.loader import embedded_checkpoint

    return AutoTokenizer.from_pretrained(embedded_checkpoint())  # converts the GGUF on first use


def test_gold_positive_structure():
    pieces = gold_trajectory(get_question(QID), random.Random(0))
    roles = [p.role for p in pieces]
    assert roles == ["env"] + ["plan", "action", "env"] * 2 + ["plan", "action", "env", "reflect"]
    assert [p.text for p in pieces if p.role == "action"] == [
        "Global Fighting Championship]",
        "Badr Hari]",
        "Badr Hari]",
    ]
    assert pieces[-1].text == "Reflect[right]"
    assert pieces[1].text in (
        "Thought: I need to search Global Fighting Championship.\nAction: Retrieve[",
        "Thought: I should look up Global Fighting Championship first.\nAction: Retrieve[",
    )
    assert pieces[3].text.startswith("\nObservation: Global Fighting Championship (also known as GFC)")
    assert pieces[-4].text == "Thought: I have the information to answer.\nAction: Finish["


def test_gold_negative_has_both_verdicts():
    pieces = gold_trajectory(get_question(QID), random.Random(0), negative=True)
    reflects = [p.text for p in pieces if p.role == "reflect"]
    finishes = [p.text for p in pieces if p.role == "action"][-2:]
    assert reflects == ["Reflect[wrong]", "Reflect[right]"]
    assert finishes[1] == "Badr Hari]" and finishes[0] != "Badr Hari]"


def test_wrong_answer_flips_yes_no():
    rng = random.Random(0)
    yes_no = [q for q in load_questions("train") if q.answer.lower() in ("yes", "no")]
    assert yes_no
    for q in yes_no:
        assert wrong_answer(q, rng) == ("no" if q.answer.lower() == "yes" else "yes")


def test_negative_fraction_is_seeded():
    questions = load_questions("train")
    a = gold_trajectories(questions, seed=3)
    assert a == gold_trajectories(questions, seed=3)
    negatives = sum(any(p.text == "Reflect[wrong]" for p in t) for t in a)
    assert 0.25 * len(a) < negatives < 0.55 * len(a)


@pytest.mark.parametrize("role", prompt.ROLES)
def test_tokenize_pieces_masks_one_role(tokenizer, role):
    pieces = gold_trajectory(get_question(QID), random.Random(0), negative=True)
    ids, labels = tokenize_pieces(tokenizer, pieces, role)
    piecewise = [tokenizer(p.text, add_special_tokens=False).input_ids for p in pieces]
    # cut right after the last piece of this role
    last = max(i for i, p in enumerate(pieces) if p.role == role)
    assert ids == [t for chunk in piecewise[: last + 1] for t in chunk]
    expected = [
        t if p.role == role else IGNORE_INDEX
        for p, chunk in zip(pieces[: last + 1], piecewise, strict=False)
        for t in chunk
    ]
    assert labels == expected
    labelled = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
    assert labelled == "".join(p.text for p in pieces if p.role == role)
