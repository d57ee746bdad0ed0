"""ScienceQA: the shipped data and its split, the offline tools, option accuracy, gold trajectories
replayed through the loop, and `precache eval --benchmark scienceqa` on a tiny random model."""

from __future__ import annotations

import ast
import dataclasses
import json
import random

import pytest
import torch

import precache
from precache.agents import prompt
from precache.agents.benchmark import HOTPOTQA, SCIENCEQA, UnknownBenchmarkError, get_benchmark
from precache.agents.data import DatasetError
from precache.agents.evaluate import summarize
from precache.agents.loop import run_episode
from precache.agents.scienceqa import (
    BANDS,
    load_questions,
    make_split,
    option_accuracy,
    parse_option,
    parse_record,
    scienceqa_dir,
)
from precache.agents.scienceqa_tools import INSTRUCTION, NO_IMAGE_TEXT, ScienceQAEnv, gold_trajectory
from precache.cli import main
from precache.errors import AdapterError
from tests.test_agents_loop import FakeSession
from tests.tiny import save_random_adapter, tiny_hf_config


def _raw() -> dict[str, dict]:
    """The shipped records by pid, read straight from the JSON files."""
    return {
        row["pid"]: row
        for band in BANDS
        for row in json.loads((scienceqa_dir() / f"{band}.json").read_text(encoding="utf-8"))
    }


@pytest.fixture(scope="module")
def questions():
    return {q.id: q for q in load_questions("all")}


# -- data and split ---------------------------------------------------------------------------
def test_the_240_questions_load_as_in_the_files(questions):
    raw = _raw()
    assert len(questions) == 240 and set(questions) == set(raw)
    assert [sum(q.band == b for q in questions.values()) for b in BANDS] == [120, 120]
    for pid, q in questions.items():
        row = raw[pid]
        assert (q.question, list(q.choices), q.answer) == (row["Question"], row["choices"], row["Answer"])
        assert q.has_image is row["metadata"]["has_image"] and q.grade == row["metadata"]["grade"]
        assert (q.band == "grade1-4") is (q.grade <= 4)
        assert q.question.endswith(" ".join(f"({x}) {c}" for x, c in zip(q.letters, q.choices, strict=True)))


def test_the_split_file_is_the_seeded_rule_and_disjoint(questions):
    shipped = json.loads((scienceqa_dir() / "split.json").read_text(encoding="utf-8"))
    assert shipped == make_split(list(questions.values()))
    train, dev = set(shipped["train"]), set(shipped["dev"])
    assert not train & dev and train | dev == set(questions)
    assert [sum(questions[i].band == b for i in dev) for b in BANDS] == [30, 30]
    assert [q.id for q in load_questions("dev")] == shipped["dev"]
    assert make_split(list(questions.values()), seed=1) != shipped  # the seed matters


BASE = _raw()["5890"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"Answer": None}, "'Answer'"),
        ({"Answer": "E"}, "'Answer' must be one of ABCD"),
        ({"choices": ["only one"]}, "'choices'"),
        ({"Question": "no options here"}, "'Question'"),
        ({"orc": "[(1, 2)]"}, "'orc'"),
        ({"caption": "no img"}, "'caption' / 'orc'"),
        ({"pid": 5890}, "'pid' must be str, got int"),
        ({"lecture": "x"}, "'lecture'"),
        ({"metadata": {**BASE["metadata"], "grade": "4"}}, "metadata: field 'grade'"),
        ({"metadata": {**BASE["metadata"], "has_image": 1}}, "field 'has_image' must be bool"),
    ],
)
def test_a_malformed_record_names_the_field(change, field):
    row = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(DatasetError, match="^grade1-4.json record 7: ") as info:
        parse_record(row, "grade1-4.json record 7", "grade1-4")
    assert field in str(info.value)


def test_missing_files_and_unknown_names(monkeypatch, tmp_path):
    with pytest.raises(DatasetError, match="unknown split 'test'"):
        load_questions("test")
    with pytest.raises(UnknownBenchmarkError, match="unknown benchmark .*benchmarks: hotpotqa, scienceqa"):
        get_benchmark("gsm8k")
    with pytest.raises(
        AdapterError, match="train it with `precache adapters train --benchmark scienceqa --set all`"
    ):
        dataclasses.replace(SCIENCEQA, adapter_root=tmp_path / "none").adapters("all")
    assert HOTPOTQA.adapters("qv").endswith("smollm2-135m/qv") and SCIENCEQA.adapters("my/dir") == "my/dir"
    monkeypatch.setenv("PRECACHE_DATA", str(tmp_path))
    with pytest.raises(DatasetError, match="grade1-4.json, grade5-8.json not found"):
        load_questions("dev")


# -- tools ------------------------------------------------------------------------------------
def test_the_image_tool_shows_exactly_the_caption_and_the_ocr_words(questions):
    raw = _raw()
    kinds = set()
    for pid, q in questions.items():
        row = raw[pid]
        observation = ScienceQAEnv(q).step("Image[image]").observation
        if row["caption"] == "no img":
            assert observation == NO_IMAGE_TEXT
            kinds.add("none")
            continue
        words = [w.strip() for _, w, _ in ast.literal_eval(row["orc"]) if w.strip()]  # blank ones dropped
        tail = f"Text in the image: {' '.join(words)}" if words else "No text in the image."
        assert observation == f"{row['caption']} {tail}"
        kinds.add("words" if words else "empty")
    assert kinds == {"none", "words", "empty"}
    with_words = next(q for q in questions.values() if q.ocr)  # one image per question: any argument
    env = ScienceQAEnv(with_words)
    assert env.step("Image[the chart]").observation == env.step("Image[image]").observation


def test_lookup_and_finish(questions):
    q = questions["5890"]  # the capital of Delaware: (A) Harrisburg (B) Dover ...
    env = ScienceQAEnv(q)
    assert env.step("Lookup[dover]").observation == "(B) Dover"
    assert env.step("Lookup[capital]").observation == "What is the capital of Delaware?"
    assert env.step("Lookup[Paris]").observation == "No line of the question or options contains Paris."
    for argument in ("B", "(B)", "B) Dover", "Dover"):
        result = env.step(f"Finish[{argument}]")
        assert (result.done, result.answer, result.observation) == (True, argument, "Finished with answer: B")
    for action in ("Finish[E]", "Finish[Paris]", "Search[x]", "Image[]", "no brackets"):
        result = env.step(action)
        assert result.error and not result.done, action


def test_option_parsing_and_accuracy(questions):
    q = questions["5890"]  # gold B = Dover, 4 options
    cases = {
        "B": "B", "(B)": "B", " ( B ) ": "B", "B.": "B", "B: Dover": "B", "(B) Dover": "B",
        "option B": "B", "Answer: C": "C", "dover": "B", "The Dover": "B", "Harrisburg": "A",
        "E": None, "(F)": None, "b": None, "Boston": None, "": None, "A painting": None,
    }  # fmt: skip
    assert {text: parse_option(text, q) for text in cases} == cases
    assert [option_accuracy(a, q) for a in ("(B)", "Dover", "A", "", "E")] == [1.0, 1.0, 0.0, 0.0, 0.0]


# -- gold trajectories through the loop --------------------------------------------------------
def _script(pieces: list[prompt.Piece]) -> dict[str, list[str]]:
    script: dict[str, list[str]] = {role: [] for role in prompt.ROLES}
    for piece in pieces:
        if piece.role != "env":
            script[piece.role].append(piece.text)
    return script


@pytest.mark.parametrize("negative", [False, True])
def test_gold_trajectories_replay_through_the_loop(questions, negative):
    rng = random.Random(0)
    for q in load_questions("train")[:6] + [questions["5890"]]:
        pieces = gold_trajectory(q, rng, negative=negative)
        assert pieces[0].text.startswith(INSTRUCTION + "\nQuestion: " + q.question)
        session = FakeSession(_script(pieces))
        episode = run_episode(session, q, benchmark=SCIENCEQA)
        assert episode.trajectory == "".join(p.text for p in pieces)
        assert session.appended == [p.text for p in pieces if p.role == "env"]
        assert episode.stop_reason == "reflect_right" and episode.accuracy == 1.0
        assert episode.answer == q.answer and episode.steps == (3 if negative else 2)
        assert len(episode.answers) == (2 if negative else 1) and option_accuracy(episode.answers[0], q) == (
            0.0 if negative else 1.0
        )
        assert "accuracy" in episode.to_dict()


def test_gold_trajectories_are_seeded_and_cover_both_verdicts():
    train = load_questions("train")
    gold_trajectories = SCIENCEQA.gold_trajectories
    a, b = gold_trajectories(train, seed=3), gold_trajectories(train, seed=3)
    assert a == b and a != gold_trajectories(train, seed=4)
    wrong = sum(any(p.role == "reflect" and p.text == "Reflect[wrong]" for p in t) for t in a)
    assert 0.25 * len(a) < wrong < 0.55 * len(a)


def test_summary_and_agreement_by_option(questions):
    q = questions["5890"]
    episodes, reference = [], []
    for mine, theirs in (("B", "Dover"), ("A", "(C)")):
        episodes.append(run_episode(FakeSession(_finish(mine)), q, benchmark=SCIENCEQA))
        reference.append(run_episode(FakeSession(_finish(theirs)), q, benchmark=SCIENCEQA))
    summary = summarize(episodes, reference, SCIENCEQA, [q, q])
    assert (summary["accuracy"], summary["agreement"]) == (0.5, 0.5)
    assert "em" not in summary and "accuracy" not in summarize(episodes, benchmark=HOTPOTQA)
    with pytest.raises(ValueError, match="needs the episodes' questions"):
        summarize(episodes, reference, SCIENCEQA)


def _finish(letter: str) -> dict[str, list[str]]:
    return {"plan": ["Thought: x\nAction: Finish["], "action": [f"{letter}]"], "reflect": ["Reflect[right]"]}


# -- the command line ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_smollm_vocab(tmp_path_factory):
    """A 2-layer random Llama over the embedded SmolLM2 tokenizer, and random q/v role adapters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from precache.models import model_from_hf
    from precache.models.loader import embedded_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint())
    config = tiny_hf_config("llama")
    config.vocab_size, config.max_position_embeddings = len(tokenizer), 2048
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("sqa-adapters")
    for i, role in enumerate(prompt.ROLES):
        save_random_adapter(hf, root / role, r=4, seed=i + 1)
    return model_from_hf(hf, tokenizer=tokenizer), root


def test_eval_scienceqa_on_two_dev_questions(tiny_smollm_vocab, monkeypatch, tmp_path, capsys):
    model, adapters = tiny_smollm_vocab
    monkeypatch.setattr(precache, "load_model", lambda *args, **kwargs: model)
    out = tmp_path / "eval.json"
    argv = ["eval", "--benchmark", "scienceqa", "--limit", "2", "--adapters", str(adapters)]
    argv += ["--max-steps", "2", "--max-new-tokens", "4", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text(encoding="utf-8"))
    dev = load_questions("dev")[:2]
    assert [e["question_id"] for e in result["episodes"]] == [q.id for q in dev]
    assert result["config"]["benchmark"] == "scienceqa" and result["summary"]["questions"] == 2
    scores = [option_accuracy(e["answer"], q) for e, q in zip(result["episodes"], dev, strict=True)]
    assert [e["accuracy"] for e in result["episodes"]] == scores
    assert result["summary"]["accuracy"] == sum(scores) / 2 and "em" not in result["summary"]
    same = [
        SCIENCEQA.answer_key(e["answer"], q) == SCIENCEQA.answer_key(r["answer"], q)
        for e, r, q in zip(result["episodes"], result["reference_episodes"], dev, strict=True)
    ]
    assert result["summary"]["agreement"] == sum(same) / 2
    assert all(e["trajectory"].startswith(INSTRUCTION) for e in result["episodes"])
    assert (
        f"prelrshared on 2 questions of scienceqa dev: accuracy={sum(scores) / 2:.3f}"
        in capsys.readouterr().out
    )


def test_hotpotqa_only_options_are_refused_with_scienceqa(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(precache, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["run", "--benchmark", "scienceqa", "--question", "nope"]) == 2
    assert "no ScienceQA question with pid 'nope'" in capsys.readouterr().err
    argv = ["eval", "--benchmark", "scienceqa", "--data", "x.jsonl", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 2
    assert "--data take(s) HotpotQA questions: not with --benchmark scienceqa" in capsys.readouterr().err
