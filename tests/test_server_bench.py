"""``precache bench serve`` end to end on a tiny checkpoint, and the ``precache serve`` flags."""

from __future__ import annotations

import argparse
import json

import pytest

from precache.bench.serve import add_bench_serve, run_serve_bench
from precache.bench.trace import Trace, TraceTurn
from precache.cli import build_parser, main
from precache.errors import AdapterError
from tests.test_server_support import char_tokenizer, tiny_with_tokenizer
from tests.tiny import tiny_model

TRACE = Trace("tiny", (TraceTurn("plan", 12, 3), TraceTurn("action", 4, 2), TraceTurn("reflect", 4, 2)))


def test_serve_flags_parse_like_vllm():
    args = build_parser().parse_args(
        ["serve", "--lora-modules", "plan=/a", "action=/b", "--method", "nonshared"]
    )
    assert args.lora_modules == [("plan", "/a"), ("action", "/b")] and args.method == "nonshared"
    assert (args.host, args.port) == ("127.0.0.1", 8000)  # loopback by default
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "plan"])


def test_bad_input_ends_a_command_with_one_line_and_exit_code_2(tmp_path, capsys):
    assert main(["serve", "--lora-modules", "plan=/a", "plan=/b"]) == 2
    err = capsys.readouterr().err
    assert err == "AdapterError: --lora-modules names the adapter 'plan' twice\n"
    assert main(["bench", "serve", "--trace", "nope", "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("TraceError: no trace file nope and no shipped trace 'nope' (shipped: ")
    assert err.count("\n") == 1 and "smoke" in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--qps", "1,0", "--json", "x.json"])


def test_bench_serve_reports_each_method_and_rate(tiny):
    model, dirs, _ = tiny
    result = run_serve_bench(
        tiny_with_tokenizer(model), dirs, ["prelrshared", "nonshared"], [20.0, 40.0], sessions=2, trace=TRACE
    )
    assert list(result["methods"]) == ["prelrshared", "nonshared"]
    for per_qps in result["methods"].values():
        assert list(per_qps) == ["20.0", "40.0"]
        for s in per_qps.values():
            assert s["errors"] == 0 and len(s["requests"]) == 2 * len(TRACE.turns)
            assert 0 < s["ttft_p50_s"] <= s["ttft_p90_s"] and s["ttft_p50_s"] <= s["latency_p50_s"]
            assert s["throughput_tok_s"] > 0
            assert all(r["completion_tokens"] == TRACE.turns[r["turn"]].decode_len for r in s["requests"])
    shared, nonshared = (result["methods"][m]["20.0"]["cached_ratio"] for m in ("prelrshared", "nonshared"))
    assert shared > 0.5 and nonshared == 0.0  # three agents, each reads a turn first under NonShared


def test_bench_serve_command_writes_json_and_plot(tiny, tmp_path):
    _, dirs, _ = tiny
    _, hf = tiny_model("llama", seed=0, num_layers=3)  # the weights the tiny adapters were made for
    hf.save_pretrained(tmp_path / "model")
    char_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "trace.csv").write_text(
        "agent,prefill_len,decode_len\nplan,12,3\naction,4,2\nreflect,4,2\n"
    )  # TRACE
    parser = argparse.ArgumentParser()
    add_bench_serve(parser.add_subparsers(dest="bench_command"))
    args = parser.parse_args(
        [
            "serve",
            "--model",
            str(tmp_path / "model"),
            "--lora-modules",
            *(f"{a}={d}" for a, d in dirs.items()),
        ]
        + [
            "--methods",
            "rebaseshared-db",
            "--qps",
            "50",
            "--sessions",
            "2",
            "--trace",
            str(tmp_path / "trace.csv"),
        ]
        + ["--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "ttft.png")]
    )
    assert args.func(args) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["trace"] == "trace" and result["methods"]["rebaseshared-db"]["50.0"]["errors"] == 0
    assert (tmp_path / "ttft.png").read_bytes()[:4] == b"\x89PNG"


def test_serve_adapters_names_a_committed_set():
    """serve --adapters qv serves the committed set's three agents; --lora-modules may add more but
    not one of its names again."""
    from precache.resources import adapter_set
    from precache.server.args import adapters_from_args

    args = build_parser().parse_args(["serve", "--adapters", "qv"])
    assert adapters_from_args(args) == {name: str(path) for name, path in adapter_set("qv").items()}
    assert sorted(adapters_from_args(args)) == ["action", "plan", "reflect"]
    extra = build_parser().parse_args(
        ["serve", "--adapters", "qv", "--lora-modules", f"x={adapter_set('qv')['plan']}"]
    )
    assert sorted(adapters_from_args(extra)) == ["action", "plan", "reflect", "x"]
    again = build_parser().parse_args(["serve", "--adapters", "qv", "--lora-modules", "plan=/a"])
    assert main(["serve", "--adapters", "qv", "--lora-modules", "plan=/a"]) == 2
    with pytest.raises(AdapterError, match="which --adapters already serves"):
        adapters_from_args(again)
