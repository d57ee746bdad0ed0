"""Trace replay: the trace loader, per-method prefill counts, the HF + PEFT oracle, reports, the CLI."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from precache.bench import plots, report
from precache.bench.hf_peft import METHOD_NAME, HFPeftAgents
from precache.bench.replay import replay_engine
from precache.bench.suite import run_suite
from precache.bench.trace import TraceError, load_trace, paper_trace, parse_trace, token_stream
from precache.cli import main
from precache.methods import METHODS
from precache.resources import trace_path
from tests.tiny import make_engine, tiny_hf_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def smoke():
    trace = load_trace(trace_path("smoke"), agents=("plan", "action", "reflect"))
    return trace, token_stream(trace, vocab_size=96, seed=0)


@pytest.fixture(scope="module")
def replays(tiny, smoke):
    model, dirs, _ = tiny
    trace, stream = smoke
    return {
        m: replay_engine(make_engine(model, dirs, m, prefix_caching=False), trace, stream) for m in METHODS
    }


# -- traces --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("long_len", "total"), [(1024, 5008), (4096, 17296)])
def test_paper_traces(long_len, total):
    trace = load_trace(trace_path(f"paper_L{long_len}"), agents=("plan", "action", "reflect"))
    assert trace.total_tokens == total
    assert len(trace.turns) == 17
    assert trace.turns == paper_trace(long_len).turns
    assert [t.agent for t in trace.turns[-2:]] == ["reflect", "reflect"]
    assert sum(t.prefill_len for t in trace.turns if t.prefill_len == long_len) == 4 * long_len


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("agent,prefill_len\nplan,4\n", "missing column(s) decode_len"),
        ("agent,prefill_len,decode_len\nplan,-3,4\n", "prefill_len must be >= 1, got -3"),
        ("agent,prefill_len,decode_len\nplan,4,4\naction,-1,4\n", "line 3: prefill_len must be >= 0"),
        ("agent,prefill_len,decode_len\nplan,4,0\n", "decode_len must be >= 1, got 0"),
        ("agent,prefill_len,decode_len\nplan,four,4\n", "prefill_len must be an integer, got 'four'"),
        ("agent,prefill_len,decode_len\nplanner,4,4\n", "agent 'planner' has no loaded adapter"),
        ("agent,prefill_len,decode_len\n,4,4\n", "empty agent name"),
        ("agent,prefill_len,decode_len\n", "no turns"),
        ("", "missing column(s) agent, prefill_len, decode_len"),
    ],
)
def test_malformed_traces(text, message):
    with pytest.raises(TraceError) as info:
        parse_trace(text, "bad", agents=("plan", "action", "reflect"))
    assert message in str(info.value)


def test_missing_trace_file(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "nope.csv")


def test_token_stream_is_seeded_and_skips_special_ids(smoke):
    trace, stream = smoke
    assert [len(ids) for ids in stream] == [t.prefill_len for t in trace.turns]
    assert stream == token_stream(trace, vocab_size=96, seed=0)
    assert stream != token_stream(trace, vocab_size=96, seed=1)
    special = list(range(0, 96, 2))
    ids = [t for turn in token_stream(trace, vocab_size=96, special_ids=special, seed=0) for t in turn]
    assert ids and all(t % 2 == 1 for t in ids)


# -- replay --------------------------------------------------------------------------------------
def _nonshared_prefill(trace) -> list[int]:
    """Honest-best NonShared by hand: each agent reads from where its own cache ends."""
    seen: dict[str, int] = {}
    n, out = 0, []
    for t in trace.turns:
        n += t.prefill_len
        out.append(n - seen.get(t.agent, 0))
        n += t.decode_len
        seen[t.agent] = n - 1  # the last generated token is read by the next turn
    return out


def test_replay_prefill_tokens_follow_the_method_definitions(smoke, replays):
    trace, _ = smoke
    once = sum(t.prefill_len for t in trace.turns) + len(trace.turns) - 1  # + each turn's pending token
    prefill = {m: [t.prefill_tokens for t in r.turns] for m, r in replays.items()}
    for m in ("fullshared", "prelrshared", "rebaseshared-lp"):
        assert sum(prefill[m]) == once, m
    assert sum(prefill["rebaseshared-db"]) == 2 * once  # the neutral row rides in the prefill
    assert prefill["nonshared"] == prefill["baseshared"] == _nonshared_prefill(trace)
    assert sum(prefill["nonshared"]) > once
    lp = replays["rebaseshared-lp"]
    assert sum(t.neutral_tokens for t in lp.turns) == trace.total_tokens - 1
    for r in replays.values():
        assert [t.new_tokens for t in r.turns] == [t.decode_len for t in trace.turns]
        assert r.metrics()["latency_s"] >= r.metrics()["ttft_s"] > 0


def test_replay_kv_bytes(tiny, smoke, replays):
    model, _, _ = tiny
    trace, _ = smoke
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # K and V, fp32
    full = replays["fullshared"]
    bs = 16  # the default block size: bytes are counted for whole allocated blocks
    assert (
        full.turns[-1].kv_bytes == full.peak_kv_bytes == -(-(trace.total_tokens - 1) // bs) * bs * per_token
    )
    # three agents, each with its own full cache over what it has read
    assert replays["nonshared"].peak_kv_bytes > 2 * full.peak_kv_bytes
    assert full.peak_kv_bytes < replays["prelrshared"].peak_kv_bytes < replays["nonshared"].peak_kv_bytes
    sizes = [t.kv_bytes for t in replays["prelrshared"].turns]
    assert sizes == sorted(sizes)


def test_hf_peft_baseline_matches_nonshared(tiny, smoke, replays):
    """The oracle: HF + PEFT with one DynamicCache per agent generates NonShared's greedy tokens,
    prefills the same tokens and holds the same KV bytes."""
    _, dirs, _ = tiny
    trace, stream = smoke
    hf = tiny_hf_model("llama", seed=0, num_layers=3)  # the weights of the `tiny` model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        baseline = HFPeftAgents(hf, dirs).replay(trace, stream)
    ours = replays["nonshared"]
    assert [t.token_ids for t in baseline.turns] == [t.token_ids for t in ours.turns]
    assert [t.prefill_tokens for t in baseline.turns] == [t.prefill_tokens for t in ours.turns]
    # ours counts whole 16-token blocks: each of the three agents' caches rounds up by < 16 tokens
    c = hf.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    assert 0 <= ours.peak_kv_bytes - baseline.peak_kv_bytes < 3 * 16 * per_token
    assert [t.token_ids for t in replays["fullshared"].turns] != [t.token_ids for t in ours.turns]


def test_replay_refuses_a_trace_past_the_context(tiny):
    model, dirs, _ = tiny
    trace = parse_trace("agent,prefill_len,decode_len\nplan,250,10\n")
    with pytest.raises(TraceError, match="needs 260 tokens, the model's context length is 256"):
        replay_engine(
            make_engine(model, dirs, "nonshared", prefix_caching=False), trace, token_stream(trace, 96)
        )


# -- suite, report, plot ---------------------------------------------------------------------------
def test_suite_medians_ratios_report_and_plot(tiny, smoke, tmp_path):
    model, dirs, _ = tiny
    trace, stream = smoke
    engines = {m: make_engine(model, dirs, m, prefix_caching=False) for m in ("nonshared", "prelrshared")}
    runners = {m: (lambda tr, st, e=e: replay_engine(e, tr, st)) for m, e in engines.items()}
    result = run_suite(runners, trace, stream, repeats=2)
    ns, pre = result["methods"]["nonshared"], result["methods"]["prelrshared"]
    assert result["repeats"] == 2 and len(ns["runs"]) == 2
    assert all(v == 1.0 for v in ns["ratio"].values() if v is not None)
    assert pre["ratio"]["prefill_tokens"] == pytest.approx(
        pre["median"]["prefill_tokens"] / ns["median"]["prefill_tokens"]
    )
    assert pre["ratio"]["prefill_tokens"] < 1.0 and pre["ratio"]["peak_kv_bytes"] < 1.0
    assert len(ns["turns"]["ttft_s"]) == len(trace.turns)
    assert result["trajectory_after_turn"][-1] == trace.total_tokens
    table = report.trace_markdown(result)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows] == ["method", "nonshared", "prelrshared"]
    assert "(1.00x)" in rows[1]
    png = plots.plot_trace(result, tmp_path / "trace.png")
    assert png.read_bytes()[:8] == PNG_MAGIC


# -- command line ----------------------------------------------------------------------------------
def test_cli_bench_trace(tiny, tmp_path, capsys):
    _, dirs, _ = tiny
    model_dir = tmp_path / "model"
    tiny_hf_model("llama", seed=0, num_layers=3).save_pretrained(model_dir)
    out = tmp_path / "out"
    # no --repeats: the smoke trace is a check, one replay per method
    argv = ["bench", "trace", "--trace", "smoke", "--model", str(model_dir)]
    argv += ["--adapters", str(Path(dirs["plan"]).parent), "--methods", "prelrshared,fullshared"]
    argv += ["--json", str(out / "r.json"), "--markdown", str(out / "r.md"), "--plot", str(out / "r.png")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert main(argv) == 0
    result = json.loads((out / "r.json").read_text())
    assert list(result["methods"]) == ["nonshared", "prelrshared", "fullshared", METHOD_NAME]
    hf, ns = result["methods"][METHOD_NAME], result["methods"]["nonshared"]
    assert hf["median"]["prefill_tokens"] == ns["median"]["prefill_tokens"]
    smoke = load_trace(trace_path("smoke"))
    assert result["trace_tokens"] == smoke.total_tokens and result["config"]["repeats"] == 1
    assert result["repeats"] == 1 and len(result["methods"]["nonshared"]["runs"]) == 1
    assert "one replay per method" in capsys.readouterr().out
    assert (out / "r.md").read_text().count("\n| ") == 5  # header + 4 rows
    assert (out / "r.png").read_bytes()[:8] == PNG_MAGIC
    assert main([*argv[:-6], "--adapters", str(tmp_path), "--json", str(out / "x.json")]) == 2
    assert "no PEFT adapter folders" in capsys.readouterr().err


def test_cli_bench_trace_measures_three_repeats_by_default(tiny, tmp_path):
    _, dirs, _ = tiny
    model_dir = tmp_path / "model"
    tiny_hf_model("llama", seed=0, num_layers=3).save_pretrained(model_dir)
    csv = tmp_path / "t.csv"
    csv.write_text("agent,prefill_len,decode_len\nplan,8,2\naction,4,2\n")
    argv = ["bench", "trace", "--trace", str(csv), "--model", str(model_dir), "--no-hf-peft"]
    argv += ["--adapters", str(Path(dirs["plan"]).parent), "--methods", "fullshared"]
    argv += ["--json", str(tmp_path / "r.json")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["repeats"] == result["config"]["repeats"] == 3
    assert all(len(entry["runs"]) == 3 for entry in result["methods"].values())


def test_warm_up_head_caps_prompt_and_decode():
    trace = paper_trace(1024)
    warm = trace.head(3, 32, 2)
    assert [(t.agent, t.prefill_len, t.decode_len) for t in warm.turns] == [
        ("plan", 32, 2),
        ("plan", 8, 2),
        ("action", 8, 2),
    ]
    assert [(t.prefill_len, t.decode_len) for t in trace.head(2, 16).turns] == [(16, 16), (8, 8)]
