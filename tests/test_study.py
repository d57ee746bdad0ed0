"""``precache study``: Figure 2 errors against HF + PEFT hidden states, the adapter-strength sweep
(scale 0 = NonShared), the table's fields, the plots and the command line."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel

import precache
from precache.agents import prompt
from precache.agents.data import load_questions
from precache.bench.study.cli import ROLES, plan_runs
from precache.bench.study.figure2 import transition_errors
from precache.bench.study.run import scaled_adapter
from precache.bench.study.stats import matching_turns
from precache.cli import main
from precache.engine import Turn
from precache.errors import AdapterError
from precache.lora.adapter import load_adapter
from tests.tiny import save_random_adapter, tiny_hf_config, tiny_hf_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IDS = [3, 17, 42, 8, 65, 11, 29, 90, 4, 51, 33, 70]


@pytest.fixture(scope="module")
def loaded(tiny):
    model, dirs, _ = tiny
    return model, dirs, {a: load_adapter(d, model.config, a) for a, d in dirs.items()}


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def test_same_agent_transition_has_zero_prelrshared_error(loaded):
    model, _, adapters = loaded
    errors = transition_errors(model, IDS, adapters["plan"], adapters["plan"])
    for method in ("prelrshared", "fullshared"):
        assert errors["k_base_error"][method] == [0.0] * model.config.num_layers
        assert errors["v_base_error"][method] == [0.0] * model.config.num_layers
    assert errors["hidden_error"]["previous"] == [0.0] * model.config.num_layers
    assert min(errors["hidden_error"]["neutral"][1:]) > 1e-3  # the neutral pass differs past layer 0
    assert min(errors["k_base_error"]["rebaseshared"][1:]) > 1e-3


def _hf_states(hf, adapter_dir):
    """Per layer: the attention input ``h`` (input RMSNorm of HF's hidden state), base K and full K
    before RoPE, from HF (+ PEFT, None: base model) with output_hidden_states."""
    model = hf if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(hf), str(adapter_dir))
    with torch.no_grad():
        hidden = model(torch.tensor([IDS]), output_hidden_states=True).hidden_states
        layers = (model if adapter_dir is None else model.base_model.model).model.layers
        out = []
        for layer, x in zip(layers, hidden, strict=False):
            h = layer.input_layernorm(x[0])
            k_proj = layer.self_attn.k_proj
            base = k_proj.base_layer if hasattr(k_proj, "base_layer") else k_proj
            out.append({"h": h, "kb": base(h), "k": k_proj(h), "vb": None})
    return out


def test_transition_errors_match_hf_peft(loaded):
    """One transition plan -> action against HF + PEFT hidden states (RoPE rotates both keys of a
    position alike, so relative errors before RoPE equal those after it)."""
    model, dirs, adapters = loaded
    hf = tiny_hf_model("llama", seed=0, num_layers=3)  # the weights of the `tiny` fixture
    own, prev, neutral = _hf_states(hf, dirs["action"]), _hf_states(hf, dirs["plan"]), _hf_states(hf, None)
    errors = transition_errors(model, IDS, adapters["plan"], adapters["action"])
    for layer in range(model.config.num_layers):
        expected = {
            "prelrshared": _relative(prev[layer]["kb"], own[layer]["kb"]),
            "rebaseshared": _relative(neutral[layer]["kb"], own[layer]["kb"]),
            "fullshared": _relative(prev[layer]["k"], own[layer]["k"]),
        }
        for method, value in expected.items():
            assert errors["k_base_error"][method][layer] == pytest.approx(value, rel=1e-4, abs=1e-6)
        assert errors["hidden_error"]["neutral"][layer] == pytest.approx(
            _relative(neutral[layer]["h"], own[layer]["h"]), rel=1e-4, abs=1e-6
        )
        assert errors["hidden_error"]["previous"][layer] == pytest.approx(
            _relative(prev[layer]["h"], own[layer]["h"]), rel=1e-4, abs=1e-6
        )
    assert errors["k_base_error"]["prelrshared"][-1] > 1e-3  # the check is not vacuous


def test_scaled_adapter_is_a_scaled_copy(loaded):
    _, _, adapters = loaded
    plan = adapters["plan"]
    before = {k: b.clone() for k, (_, b) in plan.weights.items()}
    half = scaled_adapter(plan, 0.5)
    for key, (a, b) in half.weights.items():
        assert torch.equal(a, plan.weights[key][0]) and torch.allclose(b, 0.5 * before[key])
        assert torch.equal(plan.weights[key][1], before[key])  # the loaded adapter is untouched
    assert half.scaling == plan.scaling and half.rank == plan.rank


def _turn(agent: str, appended: list[int], ids: list[int]) -> Turn:
    return Turn(agent=agent, token_ids=ids, appended=tuple(appended))


def test_matching_turns_stops_at_the_first_difference():
    ref = [_turn("plan", [1, 2], [3]), _turn("action", [4], [5, 6]), _turn("plan", [7], [8])]
    assert matching_turns(ref, ref) == 3
    other = [ref[0], _turn("action", [4], [5, 9]), ref[2]]  # the third is equal but not compared
    assert matching_turns(other, ref) == 1
    assert matching_turns(ref[:2], ref) == 2


def test_plan_runs_takes_each_benchmarks_own_set():
    runs, skipped = plan_runs("hotpotqa,scienceqa", "qv,all")
    assert [(b.name, name) for b, name, _ in runs] == [
        ("hotpotqa", "qv"),
        ("hotpotqa", "all"),
        ("scienceqa", "qv"),
        ("scienceqa", "all"),
    ]
    assert not skipped
    for bench, name, folders in runs:
        assert sorted(folders) == sorted(ROLES)
        assert all(Path(f).parent == bench.adapter_root / name for f in folders.values())


def test_plan_runs_skips_sets_not_trained_for_a_benchmark(monkeypatch, tmp_path):
    from precache.agents import benchmark

    monkeypatch.setitem(
        benchmark.BENCHMARKS, "scienceqa", dataclasses.replace(benchmark.SCIENCEQA, adapter_root=tmp_path)
    )
    runs, skipped = plan_runs("hotpotqa,scienceqa", "all")
    assert [(b.name, name) for b, name, _ in runs] == [("hotpotqa", "all")]
    assert len(skipped) == 1 and "no all adapter set for scienceqa" in skipped[0]
    with pytest.raises(AdapterError, match="nothing to run"):
        plan_runs("scienceqa", "all")


def test_cli_refuses_bad_input_before_loading(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(precache, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["study", "--methods", "nonshared,bogus", "--out", str(tmp_path)]) == 2
    assert "UnknownMethodError: unknown method(s) bogus" in capsys.readouterr().err
    assert main(["study", "--benchmark", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["study", "--scales", "1,-1", "--out", str(tmp_path)])


@pytest.fixture(scope="module")
def smollm_vocab(tmp_path_factory):
    """A 2-layer random Llama over the embedded SmolLM2 tokenizer, and random q/v role adapters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from precache.models import model_from_hf
    from precache.models.loader import embedded_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint())
    config = tiny_hf_config("llama")
    config.vocab_size, config.max_position_embeddings = len(tokenizer), 2048
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("study-adapters")
    for i, role in enumerate(prompt.ROLES):
        save_random_adapter(hf, root / role, r=4, seed=i + 1, scale=0.5)
    return model_from_hf(hf, tokenizer=tokenizer), root


def test_study_end_to_end(smollm_vocab, monkeypatch, tmp_path):
    model, root = smollm_vocab
    monkeypatch.setattr(precache, "load_model", lambda *a, **k: model)
    methods = "nonshared,fullshared,prelrshared,rebaseshared-lp"
    argv = ["study", "--benchmark", "hotpotqa", "--adapters", str(root), "--limit", "2", "--methods", methods]
    argv += ["--scales", "0,1", "--max-steps", "2", "--max-new-tokens", "4", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "study.json").read_text(encoding="utf-8"))
    run = result["runs"][f"hotpotqa/{root}"]
    assert run["questions"] == 2 and list(run["table"]) == methods.split(",")
    fields = {"em", "f1", "em_drop", "f1_drop", "agreement", "turn_match", "sum_ttft_s", "prefill_tokens"}
    for row in run["table"].values():
        assert fields | {"first_kl", "mean_kl", "top1"} <= set(row)
    ns = run["table"]["nonshared"]
    assert (
        ns["agreement"] == 1.0 and ns["turn_match"] == 1.0 and ns["mean_kl"] == 0.0 and ns["em_drop"] == 0.0
    )
    assert ns["prefill_tokens"] > 0 and ns["sum_ttft_s"] > 0
    dev = load_questions("dev")[:2]
    assert len(ns["answers"]) == len(dev)
    # DESIGN.md fact 1: scale 0 (every B = 0) makes every method NonShared
    zero = run["sweep"]["0.0"]["methods"]
    assert list(zero) == ["nonshared", "prelrshared", "rebaseshared-lp"]
    for method, row in zero.items():
        assert row["mean_kl"] < 1e-9 and row["top1"] == 1.0, method
        assert row["agreement"] == 1.0 and row["turn_match"] == 1.0, method
        assert row["parted_at"] == {"none": 2}, method
    assert run["sweep"]["1.0"]["methods"]["prelrshared"] == run["table"]["prelrshared"]
    assert run["table"]["rebaseshared-lp"]["mean_kl"] > 0  # the adapters do change the answers' logits
    fig2 = run["figure2"]
    assert fig2["transitions"] and all(t["positions"] > 0 for t in fig2["transitions"])
    layers = model.config.num_layers
    assert all(len(v) == layers for v in fig2["mean"]["k_base_error"].values())
    same = [t for t in fig2["transitions"] if t["previous"] == t["current"]]
    assert all(t["k_base_error"]["prelrshared"] == [0.0] * layers for t in same)
    assert fig2["across"] == sum(t["previous"] != t["current"] for t in fig2["transitions"])
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == 4 and all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)
    # per reading agent: NonShared is exact; the split covers every forced turn of the method
    for agent, part in ns["by_agent"].items():
        assert part["mean_kl"] == 0.0 and part["first_kl"] == 0.0, agent
    assert ns["parted_at"] == {"none": 2}  # NonShared never parts from itself
    for method, row in run["table"].items():
        assert sum(row["parted_at"].values()) == 2 and set(row["parted_at"]) <= {"none", *ROLES}, method
    forced_turns = {m: {a: p["turns"] for a, p in row["by_agent"].items()} for m, row in run["table"].items()}
    assert all(turns == forced_turns["nonshared"] for turns in forced_turns.values())  # same trajectories
    assert set(forced_turns["nonshared"]) <= set(ROLES) and sum(forced_turns["nonshared"].values()) > 0
    markdown = (tmp_path / "study.md").read_text(encoding="utf-8")
    assert "| nonshared | " in markdown and "ReBaseShared-LP beats PreLRShared on" in markdown
    assert "Settings: split dev, limit 2" in markdown and "`turn_match`" in markdown
    assert "| method | agent | turns | first_kl | mean_kl | k_error_own | k_error_other |" in markdown


def test_study_resumes_from_stored_questions(smollm_vocab, monkeypatch, tmp_path, capsys):
    """A study run again on the same --out runs nothing and writes the same tables; a run with
    other settings on that folder is refused, naming both."""
    model, root = smollm_vocab
    monkeypatch.setattr(precache, "load_model", lambda *a, **k: model)
    argv = ["study", "--adapters", str(root), "--limit", "2", "--methods", "nonshared,prelrshared"]
    argv += ["--scales", "1,0.5", "--sweep-limit", "1", "--max-steps", "2", "--max-new-tokens", "3"]
    argv += ["--concurrency", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    first = json.loads((tmp_path / "study.json").read_text(encoding="utf-8"))["runs"]
    run = first[f"hotpotqa/{root}"]
    assert run["questions"] == 2 and run["sweep_questions"] == 1
    stored = sorted(p.name for p in (tmp_path / "questions").rglob("*.json*"))
    assert stored.count("point.json") == 2 and len(stored) == 2 + 2 + 1  # 2 points, 2 + 1 questions
    import gzip

    entry = json.loads(
        gzip.decompress(next((tmp_path / "questions").glob("*/scale-1.0/*.json.gz")).read_bytes())
    )
    assert {"nonshared", "prelrshared"} == set(entry["methods"]) and "figure2" in entry

    monkeypatch.setattr(precache, "Engine", lambda *a, **k: pytest.fail("engine built on resume"))
    assert main(argv) == 0
    assert json.loads((tmp_path / "study.json").read_text(encoding="utf-8"))["runs"] == first

    # --report-only runs nothing: over a larger --limit it reports the 2 stored questions
    report_argv = [*argv, "--limit", "5", "--report-only"]  # the last --limit wins
    assert main(report_argv) == 0
    reported = json.loads((tmp_path / "study.json").read_text(encoding="utf-8"))["runs"]
    assert reported[f"hotpotqa/{root}"]["questions"] == 2
    assert reported[f"hotpotqa/{root}"]["table"] == run["table"]
    # --report-only without the run's flags takes them from the stored point
    bare = ["study", "--adapters", str(root), "--limit", "5", "--report-only", "--out", str(tmp_path)]
    assert main([*bare, "--scales", "1,0.5", "--sweep-limit", "1"]) == 0
    bare_report = json.loads((tmp_path / "study.json").read_text(encoding="utf-8"))
    assert bare_report["runs"] == reported
    assert (
        bare_report["config"]["max_new_tokens"] == 3
        and bare_report["config"]["methods"] == "nonshared,prelrshared"
    )
    assert main([*bare, "--max-new-tokens", "4"]) == 2  # given: compared with the store, not replaced
    assert "max_new_tokens 3 there, 4 now" in capsys.readouterr().err
    assert main(["study", "--adapters", str(root), "--report-only", "--out", str(tmp_path / "empty")]) == 2
    assert "nothing stored" in capsys.readouterr().err
    # a study stopped during its first group leaves point.json without questions: nothing to report
    point = next((tmp_path / "questions").glob("*/scale-1.0/point.json"))
    stopped = tmp_path / "stopped" / point.relative_to(tmp_path)
    stopped.parent.mkdir(parents=True)
    stopped.write_text(point.read_text())
    assert main(["study", "--adapters", str(root), "--report-only", "--out", str(tmp_path / "stopped")]) == 2
    assert "nothing stored" in capsys.readouterr().err
    assert main([*report_argv, "--concurrency", "4"]) == 2  # nothing runs: refused, not ignored
    assert "--concurrency would have no effect" in capsys.readouterr().err

    other = [a if a != "3" else "4" for a in argv]  # --max-new-tokens 4
    assert main(other) == 2
    err = capsys.readouterr().err
    assert "StoredResultsError" in err and "max_new_tokens 3 there, 4 now" in err


def test_a_point_run_with_other_adapter_weights_is_refused(smollm_vocab, monkeypatch, tmp_path, capsys):
    """The same adapter folder with its weights changed (here: stored in bf16) no longer matches
    the stored point, and the error names the adapters."""
    import shutil

    from precache.agents.train import store_adapter_as
    from precache.bench.study.store import adapters_fingerprint
    from precache.lora.adapter import load_adapter

    model, root = smollm_vocab
    monkeypatch.setattr(precache, "load_model", lambda *a, **k: model)
    folder = shutil.copytree(root, tmp_path / "adapters")
    argv = ["study", "--adapters", str(folder), "--limit", "1", "--methods", "nonshared", "--scales", "1"]
    argv += ["--max-steps", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "out")]
    loaded = {role: load_adapter(folder / role, model.config, role) for role in prompt.ROLES}
    same = {role: load_adapter(folder / role, model.config, role) for role in prompt.ROLES}
    assert adapters_fingerprint(loaded) == adapters_fingerprint(same)
    assert adapters_fingerprint(loaded) != adapters_fingerprint(
        {**loaded, "plan": scaled_adapter(loaded["plan"], 0.5)}
    )
    assert main(argv) == 0
    store_adapter_as(folder / "plan", "bfloat16")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "StoredResultsError" in err and "adapters '" in err and "same adapter weights" in err


def test_shards_fill_one_study_between_them(smollm_vocab, monkeypatch, tmp_path, capsys):
    """--shard 1/2 and 2/2 store the questions a single run stores (every other one each, at every
    scale) and write no report; --report-only over them equals the single run's tables."""
    model, root = smollm_vocab
    monkeypatch.setattr(precache, "load_model", lambda *a, **k: model)
    argv = ["study", "--adapters", str(root), "--limit", "3", "--methods", "nonshared,prelrshared"]
    argv += ["--scales", "1,0.5", "--sweep-limit", "2", "--max-steps", "1", "--max-new-tokens", "3"]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    single = json.loads((tmp_path / "one" / "study.json").read_text(encoding="utf-8"))["runs"]
    sharded = tmp_path / "two"
    assert main([*argv, "--shard", "1/2", "--out", str(sharded)]) == 0
    assert not (sharded / "study.json").exists()
    stored = {
        p.parent.name: sorted(x.name for x in p.parent.glob("*.json.gz")) for p in sharded.rglob("point.json")
    }
    ids = [q.id for q in load_questions("dev")[:3]]
    assert sorted(stored) == ["scale-0.5", "scale-1.0"]
    assert stored["scale-1.0"] == sorted([f"{ids[0]}.json.gz", f"{ids[2]}.json.gz"])
    assert stored["scale-0.5"] == [f"{ids[0]}.json.gz"]
    assert main([*argv, "--shard", "2/2", "--out", str(sharded)]) == 0
    assert main([*argv, "--report-only", "--out", str(sharded)]) == 0
    both = json.loads((sharded / "study.json").read_text(encoding="utf-8"))["runs"]
    key = f"hotpotqa/{root}"
    for method, row in single[key]["table"].items():
        timed = {"sum_ttft_s"}
        assert {k: v for k, v in both[key]["table"][method].items() if k not in timed} == {
            k: v for k, v in row.items() if k not in timed
        }, method
    assert (
        both[key]["sweep"]["0.5"]["methods"]["prelrshared"]["agreement"]
        == (single[key]["sweep"]["0.5"]["methods"]["prelrshared"]["agreement"])
    )
    assert main([*argv, "--report-only", "--shard", "1/2", "--out", str(sharded)]) == 2
    assert "--shard would have no effect" in capsys.readouterr().err
    for bad in ("3/2", "0/2", "1-2"):
        with pytest.raises(SystemExit):
            main([*argv, "--shard", bad, "--out", str(sharded)])


def test_figure2_means_cover_hand_overs_only():
    from precache.bench.study.figure2 import summarize_transitions

    def transition(previous, current, k, h0, hp):
        errors = {m: [k, k] for m in ("fullshared", "prelrshared", "rebaseshared")}
        return {
            "previous": previous,
            "current": current,
            "positions": 5,
            "k_base_error": errors,
            "v_base_error": errors,
            "hidden_error": {"neutral": h0, "previous": hp},
        }

    out = summarize_transitions(
        [
            transition("plan", "action", 0.2, [0.0, 0.1], [0.0, 0.3]),
            transition("plan", "plan", 0.0, [0.0, 0.5], [0.0, 0.0]),
            transition("action", "reflect", 0.4, [0.0, 0.3], [0.0, 0.2]),
        ]
    )
    assert out["across"] == 2 and len(out["transitions"]) == 3
    assert out["mean"]["k_base_error"]["prelrshared"] == pytest.approx([0.3, 0.3])
    assert out["mean"]["hidden_error"]["neutral"] == pytest.approx([0.0, 0.2])
    assert out["neutral_closer_layers"] == [1]  # 0.2 < 0.25; layer 0 ties
    none = summarize_transitions([transition("plan", "plan", 0.0, [0.0], [0.0])])
    assert none["across"] == 0 and none["mean"]["k_base_error"] == {} and none["neutral_closer_layers"] == []


def test_sign_test_matches_the_binomial_tail():
    from precache.bench.study.stats import sign_test

    assert sign_test(0, 0) == 1.0 and sign_test(3, 3) == 1.0
    assert sign_test(5, 0) == pytest.approx(2 / 32)  # 2 * P[X <= 0], X ~ Bin(5, 1/2)
    assert sign_test(1, 9) == pytest.approx(2 * (1 + 10) / 1024) == sign_test(9, 1)
    assert sign_test(10, 4) == pytest.approx(
        2 * sum(__import__("math").comb(14, k) for k in range(5)) / 2**14
    )


def test_paired_counts_questions_where_one_method_scores_higher():
    from precache.agents.benchmark import SCIENCEQA
    from precache.bench.study.stats import paired

    def q(a_agrees, a_acc, b_agrees, b_acc):
        return {
            "methods": {
                "rebaseshared-lp": {"agrees": a_agrees, "accuracy": a_acc},
                "prelrshared": {"agrees": b_agrees, "accuracy": b_acc},
            }
        }

    entries = [
        q(True, 1.0, False, 0.0),
        q(True, 0.0, True, 0.0),
        q(False, 0.0, True, 1.0),
        q(True, 1.0, False, 1.0),
    ]
    out = paired(entries, "rebaseshared-lp", "prelrshared", SCIENCEQA)
    assert out["agrees"] == {"better": 2, "worse": 1, "p": 1.0}
    assert out["accuracy"]["better"] == 1 and out["accuracy"]["worse"] == 1
    assert paired(entries, "rebaseshared-lp", "cacheblend", SCIENCEQA) == {}


def test_methods_added_to_a_stored_point_run_alone(smollm_vocab, monkeypatch, tmp_path):
    """A stored point takes a new method, and re-runs a method whose rows are at an older revision,
    running free only those: the other methods' stored rows are kept (their timings unchanged) with
    the teacher-forced records replayed again; point.json lists the union."""
    import gzip

    from precache.bench.study import store as study_store

    model, root = smollm_vocab
    monkeypatch.setattr(precache, "load_model", lambda *a, **k: model)
    argv = ["study", "--adapters", str(root), "--limit", "2", "--scales", "1", "--max-steps", "2"]
    argv += ["--max-new-tokens", "3", "--out", str(tmp_path)]
    assert main([*argv, "--methods", "nonshared,fullshared,prelrshared"]) == 0
    folder = next((tmp_path / "questions").glob("*/scale-1.0"))

    def rows():
        return {
            p.name: json.loads(gzip.decompress(p.read_bytes()))["methods"] for p in folder.glob("*.json.gz")
        }

    before = rows()
    monkeypatch.setitem(study_store.METHOD_REVISIONS, "prelrshared", 2)
    assert main([*argv, "--methods", "nonshared,prelrshared,rebaseownshared-lp"]) == 0
    after = rows()
    assert json.loads((folder / "point.json").read_text())["methods"] == [
        "nonshared",
        "fullshared",
        "prelrshared",
        "rebaseownshared-lp",
    ]
    for name, methods in after.items():
        assert set(methods) == {"nonshared", "fullshared", "prelrshared", "rebaseownshared-lp"}
        assert methods["fullshared"]["ttft_s"] == before[name]["fullshared"]["ttft_s"]  # kept, not run
        assert methods["prelrshared"]["revision"] == 2 and methods["rebaseownshared-lp"]["revision"] == 1
        assert methods["prelrshared"]["ttft_s"] != before[name]["prelrshared"]["ttft_s"]  # run again
        for m in ("fullshared", "rebaseownshared-lp"):
            assert all(t["kv_bytes"] > 0 for t in methods[m]["forced"])
    report = json.loads((tmp_path / "study.json").read_text(encoding="utf-8"))["runs"]
    table = next(iter(report.values()))["table"]
    assert table["rebaseownshared-lp"]["kv_bytes"] > table["prelrshared"]["kv_bytes"]  # own segments in full
    assert next(iter(report.values()))["paired_own"]["prelrshared"]
