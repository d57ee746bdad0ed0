"""One short real episode with the embedded SmolLM2 and the committed qv role adapters, under
every sharing method: a well-formed trajectory, a final answer, and PreLRShared prefilling fewer
tokens than NonShared."""

from __future__ import annotations

import pytest

import precache
from precache.agents.data import load_questions
from precache.agents.loop import STOP_REASONS, run_episode
from precache.agents.prompt import INSTRUCTION, ROLES
from precache.resources import adapter_set

pytestmark = pytest.mark.slow

ADAPTERS = adapter_set("qv", ROLES)


@pytest.fixture(scope="module")
def episodes():
    model = precache.load_model()
    question = load_questions("dev")[0]
    out = {}
    for method in precache.METHODS:
        engine = precache.Engine(model, adapters=ADAPTERS, method=method)
        session = engine.session()
        turns = []
        episode = run_episode(session, question, max_steps=4, max_new_tokens=48, on_turn=turns.append)
        session.check()
        out[method] = (episode, turns, session)
    return out


@pytest.mark.parametrize("method", precache.METHODS)
def test_episode_is_well_formed_and_answers(episodes, method):
    episode, turns, session = episodes[method]
    text = episode.trajectory
    assert text.startswith(INSTRUCTION) and "\nQuestion: " in text
    assert "Thought:" in text and "\nAction: " in text and "Observation: " in text
    assert [t.agent for t in turns][:2] == ["plan", "action"]
    assert episode.answer, f"{method}: no Finish[answer] in {episode.steps} steps"
    assert episode.stop_reason in STOP_REASONS
    assert 0.0 <= episode.f1 <= 1.0 and episode.em in (0.0, 1.0)
    assert session.cache_bytes()["total"] > 0


def test_prelrshared_prefills_fewer_tokens_than_nonshared(episodes):
    prefill = {m: sum(t.prefill_tokens for t in episodes[m][1]) for m in ("nonshared", "prelrshared")}
    length = {m: len(episodes[m][2]) for m in ("nonshared", "prelrshared")}
    # PreLRShared prefills each token once; NonShared re-reads what each agent has not seen
    assert prefill["prelrshared"] <= length["prelrshared"]
    assert prefill["nonshared"] > 1.5 * prefill["prelrshared"]
