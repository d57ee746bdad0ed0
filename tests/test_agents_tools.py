"""Offline tools, protocol parsers and answer scoring (no model)."""

from __future__ import annotations

import pytest

from precache.agents import prompt
from precache.agents.data import get_question
from precache.agents.scoring import exact_match, f1, normalize_answer
from precache.agents.tools import MAX_WORDS, ToolEnv, cap_paragraph, parse_action

QID = "5a832c3455429954d2e2ec41"
GFC_TEXT = (
    "Global Fighting Championship (also known as GFC) was a UAE-based kickboxing and mixed martial arts "
    "(MMA) event. Fighters from around world on the roster include Badr Hari, Peter Aerts, Peter Graham, "
    "Dewey Cooper, Zabit Samedov. It was considered as one of the biggest kickboxing and MMA promotion in "
    "Middle East."
)
HARI_2 = (
    "(Result 2 / 2) Hari has been a prominent figure in the world of kickboxing and was once considered the "
    "best kickboxer in the world, however he has been involved in a number of controversies relating to his "
    '"unsportsmanlike conducts" in the sport and crimes of violence outside of the ring.'
)


@pytest.fixture()
def env():
    return ToolEnv(get_question(QID))


def test_retrieve_exact_title_returns_capped_paragraph(env):
    result = env.step("Retrieve[Global Fighting Championship]")
    assert result.observation == GFC_TEXT  # 4 sentences: the first 3, under 80 words
    assert not result.done and not result.error and env.current_title == "Global Fighting Championship"


@pytest.mark.parametrize(
    "entity",
    ["global fighting championship", "Global Fighting Championships", " Global  Fighting Championship. "],
)
def test_retrieve_near_title(env, entity):
    assert env.step(f"Retrieve[{entity}]").observation == GFC_TEXT


def test_retrieve_parenthetical_and_bm25(env):
    assert env.find_title("Verano de Escandalo") == "Verano de Escándalo (1998)"
    assert env.find_title("Triplemania VII") == "Triplemanía VII"
    assert env.find_title("UAE kickboxing promotion roster") == "Global Fighting Championship"
    assert env.find_title("racketeers protection businesses") == "Protection racket"
    assert env.step("Retrieve[the of]").observation == "No paragraph found for the of. Try another entity."


def test_cap_paragraph_word_limit():
    sentences = ["one " * 50, "two " * 50, "three"]
    capped = cap_paragraph(sentences)
    assert capped.endswith(" ...") and len(capped.split()) == MAX_WORDS + 1
    assert cap_paragraph(["A b.", " C d.", " E f.", " G h."]) == "A b. C d. E f."


def test_lookup_cursor(env):
    assert env.step("Lookup[Hari]").observation == "No paragraph retrieved yet. Use Retrieve[entity] first."
    env.step("Retrieve[Badr Hari]")
    first = env.step("Lookup[Hari]").observation
    assert first.startswith("(Result 1 / 2) Badr Hari (Arabic:")
    assert env.step("Lookup[Hari]").observation == HARI_2
    assert env.step("Lookup[Hari]").observation == "No more results for Hari in Badr Hari."
    assert env.step("Lookup[hari]").observation == first  # a new keyword starts over (case-insensitive)
    assert env.step("Lookup[zebra]").observation == "No sentence in Badr Hari contains zebra."
    env.step("Retrieve[Global Fighting Championship]")  # a new paragraph resets the cursor
    assert env.step("Lookup[Hari]").observation.startswith("(Result 1 / 1) Fighters from around world")


def test_finish_and_errors(env):
    result = env.step("Finish[Badr Hari]")
    assert result.done and result.answer == "Badr Hari"
    assert env.step("Search[Badr]").observation == (
        "Unknown action Search. Use Retrieve[entity], Lookup[keyword] or Finish[answer]."
    )
    assert env.step("Retrieve Badr Hari").error
    assert env.step("Retrieve[ ]").observation == "Retrieve needs an argument inside the brackets."
    assert env.step("").error


def test_parse_action():
    assert parse_action("Retrieve[Badr Hari]") == ("Retrieve", "Badr Hari")
    assert parse_action(" Finish[ 1984 ] ") == ("Finish", "1984")
    assert parse_action("Finish[") is None


def test_protocol_parsers():
    assert prompt.parse_plan("Thought: find him.\nAction: Retrieve[") == ("find him.", "Retrieve")
    assert prompt.parse_plan("Thought: x\nAction: Lookup [") == ("x", "Lookup")
    assert prompt.parse_plan("Thought: no action here") is None
    assert prompt.plan_overshoot('Thought: x\nAction: Finish["') == '"'
    assert prompt.parse_argument("Badr Hari]\n") == "Badr Hari"
    assert prompt.parse_argument("Badr Hari") is None
    assert prompt.parse_reflect("Reflect[right]", strict=True) == "right"
    assert prompt.parse_reflect("Reflect[ Wrong ]") == "wrong"
    assert prompt.parse_reflect("It is wrong]", strict=True) is None
    assert prompt.parse_reflect("It is wrong]") == "wrong"
    assert prompt.parse_reflect("Reflect[maybe]") is None


def test_normalize_and_exact_match():
    assert normalize_answer("  The  Eiffel, Tower! ") == "eiffel tower"
    assert normalize_answer("An apple a day") == "apple day"
    assert exact_match("The Paris!", "paris") == 1.0
    assert exact_match("Paris, France", "Paris") == 0.0


def test_f1_values():
    assert f1("the Paris", "paris") == 1.0
    assert f1("x b c", "b c d") == pytest.approx(2 / 3)
    # "a" is an article and is dropped: "b c" vs "b c d" gives P = 1, R = 2/3, F1 = 0.8
    assert f1("a b c", "b c d") == pytest.approx(0.8)
    assert f1("b c", "x b c d") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert f1("x y", "z") == 0.0
    assert f1("yes", "no") == 0.0
    assert f1("yes it is", "yes") == 0.0  # HotpotQA: no partial credit against yes / no / noanswer
    assert f1("Yes.", "yes") == 1.0
    assert f1("", "paris") == 0.0
