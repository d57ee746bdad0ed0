"""Fidelity: teacher-forced lockstep replay against NonShared, KL / top-1, per-layer view error,
the episode orchestration, reports and plots."""

from __future__ import annotations

import pytest
import torch

from precache.bench import episodes, plots, report
from precache.bench.episodes import RecordingSession, run_fidelity, summarize_turns
from precache.bench.fidelity import compare_trajectory, forced_turn, kl_top1
from precache.engine import Turn
from precache.methods import METHODS
from tests.tiny import make_engine

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SELECTIVE = ("cacheblend", "droidspeak", "relaycaching")
# (agent, appended tokens, max new tokens) of a recorded NonShared trajectory
SCRIPT = [("plan", 14, 4), ("action", 5, 3), ("plan", 0, 3), ("reflect", 6, 4), ("action", 3, 3)]
SINGLE = [("plan", 14, 4), ("plan", 5, 3), ("plan", 6, 4)]


def record(engine, script, seed: int = 5) -> list[Turn]:
    """Run ``script`` greedily on ``engine`` (NonShared) through a RecordingSession."""
    gen = torch.Generator().manual_seed(seed)
    rec = RecordingSession(engine.session())
    for agent, n_append, n_new in script:
        if n_append:
            rec.append(torch.randint(0, 90, (n_append,), generator=gen).tolist())
        rec.generate(agent, max_new_tokens=n_new, temperature=0.0)
    return rec.turns


def compare(model, dirs, script):
    engines = {m: make_engine(model, dirs, m, prefix_caching=False) for m in METHODS}
    return compare_trajectory(engines, record(engines["nonshared"], script))


@pytest.fixture(scope="module")
def results(tiny):
    model, dirs, _ = tiny
    return compare(model, dirs, SCRIPT)


def test_recording_session_records_the_trajectory(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "nonshared", prefix_caching=False)
    turns = record(engine, SCRIPT)
    assert [(t.agent, len(t.appended), len(t.token_ids)) for t in turns] == [(a, n, g) for a, n, g in SCRIPT]
    s = engine.session()
    for t in turns:  # replaying the record free-running regenerates it (greedy, deterministic)
        s.append(list(t.appended))
        assert s.generate(t.agent, max_new_tokens=len(t.token_ids), temperature=0.0).token_ids == t.token_ids


@pytest.mark.parametrize("method", ["prelrshared", "rebaseshared-lp", "rebaseshared-db", "baseshared"])
def test_forced_turn_reproduces_generate(tiny, method):
    """Forcing a method's own greedy tokens gives back the logits it sampled them from."""
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method, prefix_caching=False)
    free, forced = engine.session(), engine.session()
    for agent, n_append, n_new in SCRIPT:
        ids = list(range(3, 3 + n_append))
        free.append(ids)
        forced.append(ids)
        turn = free.generate(agent, max_new_tokens=n_new, temperature=0.0)
        logits = forced_turn(forced, agent, turn.token_ids)
        assert logits.shape == (n_new, model.config.vocab_size)
        assert logits.argmax(-1).tolist() == turn.token_ids
        assert torch.allclose(logits[0], turn.first_logits, atol=1e-5, rtol=1e-5)
    assert forced.token_ids == free.token_ids and forced.authors == free.authors
    forced.check()


def test_kl_top1():
    ref = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    other = torch.tensor([[2.0, 0.0, -1.0], [1.0, 0.0, 0.0]])
    kl, same = kl_top1(ref, other)
    assert kl[0] == 0.0 and same == [True, False]
    p, q = torch.softmax(ref[1].double(), -1), torch.softmax(other[1].double(), -1)
    assert kl[1] == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-12)


def test_nonshared_against_itself_is_exact(results):
    for r in results["nonshared"]:
        assert r["first_kl"] == 0.0 and r["mean_kl"] == 0.0
        assert r["first_top1"] == 1.0 and r["top1"] == 1.0
        if r["position"]:
            assert r["k_error"] == [0.0] * 3 and r["v_error"] == [0.0] * 3
    assert results["nonshared"][0]["k_error"] is None  # nothing processed before the first turn


def test_sharing_methods_differ_on_random_adapters(results):
    positions = [r["position"] for r in results["fullshared"]]
    assert positions == sorted(positions) and positions[0] == 0
    for method in ("fullshared", "prelrshared", "rebaseshared-lp", "baseshared"):
        later = results[method][1:]
        assert max(r["first_kl"] for r in later) > 1e-4, method
        assert all(max(r["k_error"]) > 1e-3 for r in later), method
    # the two ReBaseShared schedules compute the same values (DESIGN.md fact 5)
    for lp, db in zip(results["rebaseshared-lp"], results["rebaseshared-db"], strict=True):
        assert db["first_kl"] == pytest.approx(lp["first_kl"], abs=1e-6)
        assert db["k_error"] == pytest.approx(lp["k_error"], abs=1e-5)


def test_zero_b_adapters_make_every_method_exact(tiny):
    """DESIGN.md fact 1: with every LoRA B = 0, every method equals NonShared."""
    model, _, zero = tiny
    for method, records in compare(model, zero, SCRIPT).items():
        for r in records:
            assert r["first_kl"] < 1e-9 and r["top1"] == 1.0, method
            if r["k_error"] is not None:
                assert max(r["k_error"] + r["v_error"]) < 1e-5, method


def test_single_agent(tiny):
    """DESIGN.md fact 1: with one agent every method but ReBaseShared equals NonShared."""
    model, dirs, _ = tiny
    results = compare(model, dirs, SINGLE)
    for method, records in results.items():
        worst = max(max(r["k_error"] + r["v_error"]) for r in records[1:])
        if method.startswith("rebaseshared"):
            assert worst > 1e-3, method  # the neutral base differs even over the agent's own segments
        else:
            assert worst < 1e-5 and all(r["first_kl"] < 1e-9 for r in records), method


def test_summarize_turns():
    records = [
        {
            "tokens": 2,
            "first_kl": 0.5,
            "mean_kl": 0.3,
            "first_top1": 1.0,
            "top1": 0.5,
            "k_error": None,
            "v_error": None,
        },
        {
            "tokens": 4,
            "first_kl": 0.1,
            "mean_kl": 0.6,
            "first_top1": 0.0,
            "top1": 1.0,
            "k_error": [0.1, 0.3],
            "v_error": [0.2, 0.2],
        },
        {
            "tokens": 2,
            "first_kl": 0.0,
            "mean_kl": 0.0,
            "first_top1": 1.0,
            "top1": 1.0,
            "k_error": [0.3, 0.5],
            "v_error": [0.0, 0.4],
        },
    ]
    s = summarize_turns(records)
    assert s["turns"] == 3
    assert s["first_kl"] == pytest.approx(0.2) and s["first_top1"] == pytest.approx(2 / 3)
    assert s["mean_kl"] == pytest.approx((0.6 + 2.4) / 8) and s["top1"] == pytest.approx(7 / 8)
    assert s["k_error_per_layer"] == pytest.approx([0.2, 0.4]) and s["k_error"] == pytest.approx(0.3)
    assert s["v_error_per_layer"] == pytest.approx([0.1, 0.3])


class _Question:
    def __init__(self, qid: str, answer: str):
        self.id, self.answer = qid, answer


class _Episode:
    def __init__(self, answer: str, gold: str):
        self.answer, self.em, self.f1 = answer, float(answer == gold), float(answer == gold)


def _fake_episode(session, question, max_new_tokens=3, **_):
    """A stand-in for the agent loop on a tokenizer-less tiny model: fixed appends, greedy turns;
    the 'answer' is the last generated token."""
    out = None
    for agent, n_append, _n in SCRIPT[:3]:
        session.append([(7 * len(session) + i) % 90 for i in range(n_append)])
        out = session.generate(agent, max_new_tokens=max_new_tokens, temperature=0.0)
    return _Episode(str(out.token_ids[-1]), question.answer)


def test_run_fidelity_and_reports(tiny, monkeypatch, tmp_path):
    model, dirs, _ = tiny
    monkeypatch.setattr(episodes, "run_episode", _fake_episode)
    engines = {
        m: make_engine(model, dirs, m, prefix_caching=False)
        for m in ("nonshared", "fullshared", "prelrshared")
    }
    questions = [_Question("q1", "5"), _Question("q2", "x")]
    result = run_fidelity(engines, questions, max_new_tokens=3)
    assert result["episodes"] == 2 and result["turns"] == 6
    ns = result["methods"]["nonshared"]
    assert ns["agreement"] == 1.0 and ns["first_kl"] == 0.0 and ns["top1"] == 1.0 and ns["k_error"] == 0.0
    assert result["methods"]["fullshared"]["k_error"] > 0
    assert [r["question"] for r in result["per_turn"]["prelrshared"]] == ["q1"] * 3 + ["q2"] * 3
    assert len(result["methods"]["prelrshared"]["k_error_per_layer"]) == model.config.num_layers
    table = report.fidelity_markdown(result)
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")] == [
        "method",
        "nonshared",
        "fullshared",
        "prelrshared",
    ]
    paths = plots.plot_fidelity(result, tmp_path / "plots")
    assert [p.name for p in paths] == ["layer_error.png", "kl_per_turn.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)


def test_own_and_other_segment_errors(tiny, results):
    """The own / other split covers the earlier positions by writer: with one agent every earlier
    position is its own (no ``_other``) and only ReBaseShared has an error there; on the mixed
    script the two parts recombine into the whole error (squared norms add up)."""
    model, dirs, _ = tiny
    for method, records in compare(model, dirs, SINGLE).items():
        for r in records[1:]:
            assert r["k_error_other"] is None and r["k_error_own"] == r["k_error"], method
            assert (max(r["k_error"]) > 1e-3) == method.startswith("rebaseshared"), method
    # SCRIPT turn 2 is plan after plan's turn 0 and action's turn 1; turn 1 (action) has only plan's
    plan_again = results["prelrshared"][2]
    assert plan_again["k_error_own"] is not None and plan_again["k_error_other"] is not None
    assert results["prelrshared"][1]["k_error_own"] is None
    engines = {m: make_engine(model, dirs, m, prefix_caching=False) for m in ("nonshared", "rebaseshared-lp")}
    turns = record(engines["nonshared"], SCRIPT)
    ref, other = engines["nonshared"].session(), engines["rebaseshared-lp"].session()
    for i, t in enumerate(turns[:3]):  # measured after turn 2 over what came before it
        end = len(ref.token_ids) if i == 2 else None
        for s in (ref, other):
            s.append(list(t.appended))
            forced_turn(s, t.agent, t.token_ids)
    own = torch.tensor([True] * (14 + 4) + [False] * (end - 18))  # plan wrote turn 0's 18 tokens
    from precache.bench.fidelity import agent_kv, split_layer_errors

    errors = split_layer_errors(ref, other, "plan", end, {"whole": None, "own": own, "other": ~own})
    (whole, _), (mine, _), (theirs, _) = errors["whole"], errors["own"], errors["other"]
    for layer in range(model.config.num_layers):
        k_ref = agent_kv(ref, "plan", layer, end)[0].double()
        n_own, n_other = k_ref[own].norm() ** 2, k_ref[~own].norm() ** 2
        recombined = (mine[layer] ** 2 * n_own + theirs[layer] ** 2 * n_other) / (n_own + n_other)
        assert float(recombined) ** 0.5 == pytest.approx(whole[layer], rel=1e-6)


def test_fidelity_answers_follow_the_benchmark():
    """On ScienceQA two answers agree when they name the same option (a letter or the option's
    text), and the summary carries option accuracy; on HotpotQA the normalised answers must match."""
    from types import SimpleNamespace

    from precache.agents.benchmark import get_benchmark
    from precache.bench.episodes import _answers

    scienceqa = get_benchmark("scienceqa")
    question = scienceqa.load_questions("dev")[0]
    gold = question.letters.index(question.answer)
    other = (gold + 1) % len(question.letters)
    ref = [SimpleNamespace(answer=question.answer, accuracy=1.0)] * 3
    episodes = [
        SimpleNamespace(answer=f"({question.answer})", accuracy=1.0),
        SimpleNamespace(answer=question.choices[gold], accuracy=1.0),
        SimpleNamespace(answer=question.letters[other], accuracy=0.0),
    ]
    summary = _answers(episodes, ref, [question] * 3, scienceqa)
    assert summary["agreement"] == pytest.approx(2 / 3) and summary["accuracy"] == pytest.approx(2 / 3)
    assert "em" not in summary
    hotpotqa = get_benchmark("hotpotqa")
    hp = SimpleNamespace(answer="The Eiffel Tower", em=1.0, f1=1.0)
    summary = _answers([hp, hp], [SimpleNamespace(answer="eiffel tower")] * 2, [None, None], hotpotqa)
    assert summary["agreement"] == 1.0 and summary["em"] == 1.0 and summary["f1"] == 1.0
    assert (
        report.fidelity_markdown(
            {
                "benchmark": "scienceqa",
                "metrics": ["accuracy"],
                "episodes": 3,
                "turns": 9,
                "methods": {"x": summary},
            }
        ).count("option accuracy")
        == 1
    )
