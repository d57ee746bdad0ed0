"""The llama.cpp baseline of ``bench trace``: its names, its refusal when llama.cpp is not built,
and, where ``make llama-cpp`` has built it, its replay against NonShared (the same greedy tokens
and prefill counts at f32 with one slot per agent; one slot recomputes at every adapter switch)."""

from __future__ import annotations

import warnings

import pytest

from precache.bench.llama_cpp import CONFIGS, llama_cpp_runners, parse_baselines
from precache.bench.llama_cpp_gguf import LlamaCppMissingError, find_llama_cpp
from precache.cli import main
from precache.errors import PrecacheError


def test_parse_baselines():
    assert parse_baselines("hf-peft,llama-cpp") == ["hf-peft", *CONFIGS]
    assert parse_baselines("llama-cpp-q8_0, hf-peft,llama-cpp-q8_0") == ["llama-cpp-q8_0", "hf-peft"]
    assert parse_baselines("") == []
    with pytest.raises(PrecacheError, match="unknown baseline 'vllm'.*known: hf-peft, llama-cpp"):
        parse_baselines("hf-peft,vllm")


def test_missing_llama_cpp_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv("PRECACHE_LLAMA_CPP", str(tmp_path))
    with pytest.raises(LlamaCppMissingError, match=r"make llama-cpp.*PRECACHE_LLAMA_CPP"):
        find_llama_cpp()
    # no llama.cpp configuration asked for: nothing is looked up
    with llama_cpp_runners([], tmp_path, {}, None, None, 2) as runners:
        assert runners == {}


def test_bench_trace_refuses_llama_cpp_when_not_built(tiny, tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from tests.tiny import tiny_hf_model

    _, dirs, _ = tiny
    monkeypatch.setenv("PRECACHE_LLAMA_CPP", str(tmp_path / "none"))
    model_dir = tmp_path / "model"
    tiny_hf_model("llama", seed=0, num_layers=3).save_pretrained(model_dir)
    argv = ["bench", "trace", "--trace", "smoke", "--model", str(model_dir), "--methods", "fullshared"]
    argv += ["--adapters", str(Path(dirs["plan"]).parent), "--baselines", "llama-cpp"]
    argv += ["--json", str(tmp_path / "r.json")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert main(argv) == 2
    assert "make llama-cpp" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
    assert main([*argv[:-4], "--baselines", "hf-peft,llamacpp", "--json", str(tmp_path / "r.json")]) == 2
    assert "unknown baseline 'llamacpp'" in capsys.readouterr().err
    assert main([*argv, "--device", "cuda"]) == 2
    assert "built for the CPU here" in capsys.readouterr().err


def _built():
    try:
        find_llama_cpp()
    except LlamaCppMissingError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _built(), reason="llama.cpp is not built (`make llama-cpp`)")
def test_llama_cpp_f32_replays_nonshared_exactly():
    import precache
    from precache.bench.common import special_ids
    from precache.bench.replay import replay_engine
    from precache.bench.trace import parse_trace, token_stream
    from precache.resources import adapter_set

    trace = parse_trace("agent,prefill_len,decode_len\nplan,120,6\naction,8,8\nreflect,8,8\nplan,8,6\n")
    model = precache.load_model(None)
    adapters = adapter_set("qv", trace.agents)
    stream = token_stream(trace, model.config.vocab_size, special_ids(model), seed=3)
    engine = precache.Engine(model, adapters=adapters, method="nonshared", prefix_caching=False)
    ours = replay_engine(engine, trace, stream)
    configs = ["llama-cpp-f32", "llama-cpp-f32-1slot"]
    with llama_cpp_runners(configs, model.path, adapters, model.config, trace, 2) as runners:
        per_agent, one_slot = (runners[c](trace, stream) for c in configs)
    assert [t.token_ids for t in per_agent.turns] == [t.token_ids for t in ours.turns]
    assert [t.prefill_tokens for t in per_agent.turns] == [t.prefill_tokens for t in ours.turns]
    assert [t.token_ids for t in one_slot.turns] == [t.token_ids for t in ours.turns]
    # one slot: every adapter switch prefills the whole trajectory again
    before = [sum(t.prefill_len + t.decode_len for t in trace.turns[:i]) for i in range(len(trace.turns))]
    expected = [b + t.prefill_len for b, t in zip(before, trace.turns, strict=True)]
    assert [t.prefill_tokens for t in one_slot.turns] == expected
    assert all(t.ttft_s > 0 and t.decode_s > 0 for t in per_agent.turns)
