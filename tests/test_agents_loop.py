"""The plan / action / reflect loop on scripted agent outputs (no model)."""

from __future__ import annotations

import random

import pytest

from precache.agents import prompt
from precache.agents.data import get_question
from precache.agents.gold import gold_trajectory
from precache.agents.loop import run_episode
from precache.engine import Turn

QID = "5a832c3455429954d2e2ec41"  # "Who was once considered the best kick boxer ...", answer Badr Hari
GFC_TEXT = (
    "Global Fighting Championship (also known as GFC) was a UAE-based kickboxing and mixed martial arts "
    "(MMA) event. Fighters from around world on the roster include Badr Hari, Peter Aerts, Peter Graham, "
    "Dewey Cooper, Zabit Samedov. It was considered as one of the biggest kickboxing and MMA promotion in "
    "Middle East."
)


class FakeSession:
    """Implements the engine session contract with scripted outputs; one token per character."""

    def __init__(self, script: dict[str, list[str]], max_context: int | None = None) -> None:
        self.script = {agent: list(texts) for agent, texts in script.items()}
        self.appended: list[str] = []
        self.calls: list[tuple[str, list[str]]] = []
        self.token_ids: list[int] = []
        if max_context is not None:
            self.max_context = max_context

    def append(self, text: str) -> None:
        self.appended.append(text)
        self.token_ids += [ord(ch) for ch in text]

    def generate(self, agent: str, max_new_tokens: int, temperature: float, stop: list[str]):
        self.calls.append((agent, stop))
        text = self.script[agent].pop(0)
        ids = [ord(ch) for ch in text]
        self.token_ids += ids
        return Turn(
            agent=agent,
            token_ids=ids,
            text=text,
            ttft_s=0.01,
            decode_s=0.02,
            prefill_tokens=len(ids),
            stop_reason="stop",
        )

    def __len__(self) -> int:
        return len(self.token_ids)


def plan(thought: str, kind: str) -> str:
    return f"Thought: {thought}\nAction: {kind}["


@pytest.fixture(scope="module")
def question():
    return get_question(QID)


def test_happy_path_exact_trajectory(question):
    session = FakeSession(
        {
            "plan": [plan("I need GFC.", "Retrieve"), plan("I can answer.", "Finish")],
            "action": ["Global Fighting Championship]", "Badr Hari]"],
            "reflect": ["Reflect[right]"],
        }
    )
    seen = []
    episode = run_episode(session, question, on_turn=seen.append)
    assert episode.stop_reason == "reflect_right"
    assert episode.answer == "Badr Hari" and episode.em == 1.0 and episode.f1 == 1.0
    assert session.appended == [prompt.header(question.question), f"\nObservation: {GFC_TEXT}\n", "\n"]
    assert [agent for agent, _ in session.calls] == ["plan", "action", "plan", "action", "reflect"]
    assert [stop for _, stop in session.calls] == [["["], ["]"], ["["], ["]"], ["]"]]
    assert [t.agent for t in seen] == [t.agent for t in episode.turns] and len(seen) == 5
    expected = (
        prompt.header(question.question)
        + "Thought: I need GFC.\nAction: Retrieve[Global Fighting Championship]"
        + f"\nObservation: {GFC_TEXT}\n"
        + "Thought: I can answer.\nAction: Finish[Badr Hari]\nReflect[right]"
    )
    assert episode.trajectory == expected
    assert len(session) == len(expected)
    assert episode.steps == 2


def test_malformed_and_unknown_actions_give_error_observations(question):
    session = FakeSession(
        {
            "plan": ["I am not sure what to do.", plan("Search it.", "Search"), plan("Done.", "Finish")],
            "action": ["kick boxer]", "Badr Hari]"],
            "reflect": ["Reflect[right]"],
        }
    )
    episode = run_episode(session, question)
    assert (
        session.appended[1]
        == "\nObservation: Invalid step. Write Thought: ... then Action: Type[argument].\n"
    )
    assert session.appended[2] == (
        "\nObservation: Unknown action Search. Use Retrieve[entity], Lookup[keyword] or Finish[answer].\n"
    )
    assert [agent for agent, _ in session.calls] == ["plan", "plan", "action", "plan", "action", "reflect"]
    assert episode.answer == "Badr Hari" and episode.stop_reason == "reflect_right" and episode.steps == 3


def test_unclosed_argument_is_an_error(question):
    session = FakeSession(
        {
            "plan": [plan("a", "Retrieve"), plan("b", "Finish")],
            "action": ["Badr Hari and more", "x]"],
            "reflect": ["Reflect[wrong]"],
        }
    )
    episode = run_episode(session, question, max_retries=0)
    assert session.appended[1] == "\nObservation: Invalid action: Retrieve[ was not closed with ].\n"
    assert episode.stop_reason == "retries_exhausted" and episode.answer == "x" and episode.em == 0.0


def test_plan_overshoot_starts_the_argument(question):
    session = FakeSession(
        {
            "plan": [plan("a", "Retrieve") + "Global", plan("b", "Finish") + "Badr Hari]"],
            "action": [" Fighting Championship]"],
            "reflect": ["Reflect[right]"],
        }
    )
    episode = run_episode(session, question)
    assert session.appended[1] == f"\nObservation: {GFC_TEXT}\n"
    # the second plan turn closed the bracket itself: no action turn for it
    assert [agent for agent, _ in session.calls] == ["plan", "action", "plan", "reflect"]
    assert episode.answer == "Badr Hari"


def test_retry_after_reflect_wrong(question):
    session = FakeSession(
        {
            "plan": [plan("guess", "Finish"), plan("again", "Finish")],
            "action": ["Peter Aerts]", "Badr Hari]"],
            "reflect": ["Reflect[wrong]", "Reflect[right]"],
        }
    )
    episode = run_episode(session, question, max_retries=1)
    assert episode.answers == ["Peter Aerts", "Badr Hari"]
    assert episode.answer == "Badr Hari" and episode.em == 1.0
    assert episode.stop_reason == "reflect_right"
    assert session.appended[1:] == [prompt.FINISH_SEPARATOR, prompt.RETRY_SEPARATOR, prompt.FINISH_SEPARATOR]


def test_retries_are_bounded(question):
    session = FakeSession(
        {
            "plan": [plan("x", "Finish")] * 3,
            "action": ["Peter Aerts]", "Peter Graham]", "Dewey Cooper]"],
            "reflect": ["Reflect[wrong]"] * 3,
        }
    )
    episode = run_episode(session, question, max_retries=2)
    assert episode.answers == ["Peter Aerts", "Peter Graham", "Dewey Cooper"]
    assert episode.stop_reason == "retries_exhausted" and episode.answer == "Dewey Cooper"
    assert episode.f1 == 0.0


def test_unparsed_verdict_stops(question):
    session = FakeSession({"plan": [plan("x", "Finish")], "action": ["Badr Hari]"], "reflect": ["Hmm."]})
    episode = run_episode(session, question)
    assert episode.stop_reason == "reflect_unparsed" and episode.em == 1.0


def test_step_limit(question):
    session = FakeSession({"plan": [plan("look", "Lookup")] * 5, "action": ["Hari]"] * 5})
    episode = run_episode(session, question, max_steps=3)
    assert episode.stop_reason == "max_steps" and episode.steps == 3
    assert len(episode.turns) == 6 and episode.answer == "" and episode.em == 0.0
    obs = "\nObservation: No paragraph retrieved yet. Use Retrieve[entity] first.\n"
    assert session.appended[1:] == [obs] * 3


def test_context_limit(question):
    header_len = len(prompt.header(question.question))
    session = FakeSession(
        {"plan": [plan("a", "Retrieve")], "action": ["Badr Hari]"]}, max_context=header_len + 100
    )
    episode = run_episode(session, question, max_new_tokens=40)
    # header + 2 turns fit; the observation (~490 chars) does not
    assert episode.stop_reason == "context_length"
    assert [t.agent for t in episode.turns] == ["plan", "action"]
    session = FakeSession({"plan": [plan("a", "Retrieve")]}, max_context=header_len + 10)
    episode = run_episode(session, question, max_new_tokens=40)
    assert episode.stop_reason == "context_length" and episode.turns == []


@pytest.mark.parametrize("negative", [False, True])
def test_gold_trajectory_replays_exactly(question, negative):
    """Training sequences are the very pieces the loop writes when agents emit the gold outputs."""
    pieces = gold_trajectory(question, random.Random(0), negative=negative)
    script = {role: [p.text for p in pieces if p.role == role] for role in prompt.ROLES}
    session = FakeSession(script)
    episode = run_episode(session, question, max_retries=1)
    assert episode.pieces == pieces
    assert episode.stop_reason == "reflect_right" and episode.em == 1.0
