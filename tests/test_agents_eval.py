"""Evaluation summary, agreement, form-check judging and the CLI wiring (no real model)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from precache.agents import prompt
from precache.agents.data import get_question
from precache.agents.evaluate import evaluate, summarize
from precache.agents.formcheck import (
    MAX_NEW_TOKENS,
    _judge,
    _rates,
    greedy_continue,
    teacher_forced_continuations,
)
from precache.agents.gold import gold_trajectory
from precache.agents.loop import Episode
from tests.test_agents_loop import FakeSession, plan

QID = "5a832c3455429954d2e2ec41"


def _script(answer: str) -> dict[str, list[str]]:
    return {"plan": [plan("x", "Finish")], "action": [f"{answer}]"], "reflect": ["Reflect[right]"]}


def test_evaluate_em_f1_agreement():
    question = get_question(QID)
    answers = iter(["Badr Hari", "Peter Aerts"])
    reference = iter(["the Badr Hari", "Peter Graham"])
    result = evaluate(
        lambda: FakeSession(_script(next(answers))),
        [question, question],
        reference_session=lambda: FakeSession(_script(next(reference))),
    )
    summary = result["summary"]
    assert summary["em"] == 0.5 and summary["f1"] == 0.5
    assert summary["agreement"] == 0.5  # "the Badr Hari" normalises to "badr hari"
    assert summary["stop_reasons"] == {"reflect_right": 2}
    assert summary["agents"]["plan"]["turns"] == 2 and summary["agents"]["reflect"]["mean_ttft_s"] == 0.01
    assert [e["answer"] for e in result["reference_episodes"]] == ["the Badr Hari", "Peter Graham"]
    assert result["episodes"][0]["trajectory"].endswith("Action: Finish[Badr Hari]\nReflect[right]")


def test_evaluate_with_concurrency_keeps_the_question_order():
    question = get_question(QID)
    questions = [question] * 5
    scripts = {"Badr Hari": 0, "Peter Aerts": 0}

    def session(answer):
        def make():
            scripts[answer] += 1
            return FakeSession(_script(answer))

        return make

    one = evaluate(session("Badr Hari"), questions, reference_session=session("Peter Aerts"))
    four = evaluate(session("Badr Hari"), questions, reference_session=session("Peter Aerts"), concurrency=4)
    assert scripts == {"Badr Hari": 10, "Peter Aerts": 10}  # one fresh session per question and run
    assert four["summary"] == one["summary"] and four["summary"]["agreement"] == 0.0
    assert [e["answer"] for e in four["episodes"]] == ["Badr Hari"] * 5
    assert [e["answer"] for e in four["reference_episodes"]] == ["Peter Aerts"] * 5


def test_summarize_rejects_mismatched_reference():
    with pytest.raises(ValueError, match="other questions"):
        summarize([Episode(question_id="a")], [Episode(question_id="b")])


def test_judge_forms():
    question = get_question(QID)
    pieces = gold_trajectory(question, random.Random(0), negative=True)
    retrieve_plan, finish_plan = pieces[1], pieces[-4]
    judge = _judge
    assert judge("plan", "Thought: hi\nAction: Lookup[", retrieve_plan, pieces[0], question) == {
        "form": True,
        "type_match": False,
    }
    assert judge("plan", "Observation: x", retrieve_plan, pieces[0], question)["form"] is False
    assert judge("action", "badr hari]", pieces[2], retrieve_plan, question)["retrieve_title"] is True
    assert judge("action", "Badr]", pieces[2], retrieve_plan, question)["retrieve_title"] is False
    finish = judge("action", "Badr Hari]", pieces[-3], finish_plan, question)
    assert finish == {"form": True, "finish_closed": True, "finish_answer_em": True}
    gold_wrong = next(p for p in pieces if p.text == "Reflect[wrong]")
    assert judge("reflect", "Reflect[wrong]", gold_wrong, pieces[0], question) == {
        "form": True,
        "verdict_acc": True,
    }
    assert judge("reflect", "right]", gold_wrong, pieces[0], question) == {
        "form": False,
        "verdict_acc": False,
    }
    rates = _rates({"adapter": [{"form": True}, {"form": False}], "base": [{"form": False}, {"form": False}]})
    assert rates == {"n": 2, "adapter": {"form": 0.5}, "base": {"form": 0.0}}


class CharTokenizer:
    """One token per letter (id = ord % 63); 63 is EOS."""

    eos_token_id = 63

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(ch) % 63 for ch in text])


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def test_greedy_continue_matches_hf_generate():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = _tiny_llama()
    prefix = [1, 2, 3, 4]
    reference = model.generate(torch.tensor([prefix]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    text = CharTokenizer().decode(reference[0, len(prefix) :].tolist())
    assert greedy_continue(model, CharTokenizer(), prefix, 12, stop=["#"])[0] == text
    stop = text[5]
    expected = text[: text.index(stop) + 1]
    assert greedy_continue(model, CharTokenizer(), prefix, 12, stop=[stop])[0] == expected


def test_teacher_forced_continuations_reuse_the_prefix_cache():
    """One pass with a cut-back cache gives what a fresh greedy run from each prefix gives."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(2)
    model, tok = _tiny_llama(), CharTokenizer()
    pieces = [
        prompt.Piece("env", "question"),
        prompt.Piece("plan", "think["),
        prompt.Piece("action", "arg]"),
        prompt.Piece("env", "observe"),
        prompt.Piece("plan", "more["),
        prompt.Piece("action", "x]"),
    ]
    texts = teacher_forced_continuations(model, tok, pieces, ("plan", "action"))
    assert sorted(texts) == [1, 2, 4, 5]
    for index, text in texts.items():
        prefix = [t for p in pieces[:index] for t in tok(p.text).input_ids]
        role = pieces[index].role
        fresh, _ = greedy_continue(model, tok, prefix, MAX_NEW_TOKENS[role], prompt.STOP_STRINGS[role])
        assert text == fresh


def test_cli_registers_commands():
    from precache.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["adapters", "train", "--set", "all", "--steps", "5"])
    assert (args.set, args.steps, args.func.__name__) == ("all", 5, "_train")
    args = parser.parse_args(
        ["eval", "--split", "dev", "--method", "nonshared", "--limit", "3", "--json", "x"]
    )
    assert (args.method, args.limit, args.adapters, args.func.__name__) == ("nonshared", 3, "qv", "_eval")
    assert args.concurrency == 1
    assert parser.parse_args(["eval", "--json", "x", "--concurrency", "4"]).concurrency == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--json", "x", "--concurrency", "0"])
    args = parser.parse_args(["run", "--question", QID, "--adapters", "all"])
    assert (args.method, args.adapters, args.func.__name__) == ("prelrshared", "all", "_run")
    check = parser.parse_args(["adapters", "check", "--set", "qv", "all"])
    assert (check.set, check.limit) == (["qv", "all"], 20)
    assert prompt.STOP_STRINGS == {"plan": ["["], "action": ["]"], "reflect": ["]"]}
