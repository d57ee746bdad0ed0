"""DroidSpeak's offline profile per benchmark: the calibration text of HotpotQA and ScienceQA,
``precache adapters profile-droidspeak --benchmark``, and the committed profiles."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import precache.models
from precache.agents import data, scienceqa
from precache.agents.benchmark import SCIENCEQA, UnknownBenchmarkError
from precache.agents.calibration import adapter_folders, calibration, calibration_name, calibration_text
from precache.cli import main
from precache.errors import AdapterError
from precache.lora.adapter import load_adapter
from precache.methods.droidspeak import PROFILE_FILE, profile, read_profile
from precache.models import _load_tokenizer, model_from_hf, resolve_checkpoint
from precache.resources import ADAPTER_ROOT
from tests.tiny import AGENTS, save_random_adapter

SCIENCEQA_ROOT = ADAPTER_ROOT.parent / "smollm2-135m-scienceqa"


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer (the one the committed profiles used)."""
    return _load_tokenizer(resolve_checkpoint(None), True)


def test_scienceqa_calibration_is_the_first_train_questions(tokenizer):
    first = scienceqa.load_questions("train")[0]
    seqs = calibration(tokenizer, "scienceqa")
    assert len(seqs) == 4 and all(0 < len(s) <= 128 for s in seqs)
    text = tokenizer.decode(seqs[0])
    # the question, its options and its image (caption, then the OCR line the Image tool shows)
    assert text.startswith(first.question) and "Options: (A)" in text
    assert first.caption in text and text.endswith("No text in the image.")
    no_image = scienceqa.load_questions("train")[1]
    assert not no_image.has_image and calibration_text(no_image, "scienceqa") == no_image.question
    assert tokenizer.decode(seqs[1]) == no_image.question
    assert calibration(tokenizer, "scienceqa", n=2, tokens=5) == [s[:5] for s in seqs[:2]]
    assert calibration_name("scienceqa") == "scienceqa train[:4], at most 128 tokens each"


def test_hotpotqa_calibration_is_the_question_and_its_paragraphs(tokenizer):
    first = data.load_questions("train")[0]
    seqs = calibration(tokenizer, "hotpotqa")
    assert len(seqs) == 4 and all(len(s) == 128 for s in seqs)  # the paragraphs are longer than 128
    title, sentences = first.context[0]
    assert tokenizer.decode(seqs[0]).startswith(f"{first.question}\n{title}: {sentences[0]}"[:100])
    assert calibration(tokenizer) == seqs  # the default: what the committed HotpotQA profiles used
    with pytest.raises(UnknownBenchmarkError, match="unknown benchmark 'bogus'"):
        calibration(tokenizer, "bogus")


def test_committed_sets_resolve_to_the_benchmarks_folder(tmp_path):
    sq = adapter_folders("qv", "scienceqa")
    assert sq == {a: SCIENCEQA_ROOT / "qv" / a for a in sorted(AGENTS)}
    assert SCIENCEQA.adapter_root == SCIENCEQA_ROOT
    assert adapter_folders("qv") == {a: ADAPTER_ROOT / "qv" / a for a in sorted(AGENTS)}
    # a folder is taken as given, whatever the benchmark
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "adapter_config.json").write_text("{}")
    assert adapter_folders(str(tmp_path), "scienceqa") == {"plan": tmp_path / "plan"}
    with pytest.raises(AdapterError, match="no PEFT adapter folders"):
        adapter_folders(str(tmp_path / "nowhere"), "scienceqa")


@pytest.fixture
def no_model(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(precache.models, "load_model", boom)


def test_bad_benchmark_or_folder_exits_2_before_the_model_loads(no_model, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["adapters", "profile-droidspeak", "--benchmark", "bogus"])
    assert info.value.code == 2
    assert "--benchmark: invalid choice: 'bogus'" in capsys.readouterr().err
    assert (
        main(["adapters", "profile-droidspeak", "--benchmark", "scienceqa", "--adapters", str(tmp_path)]) == 2
    )
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"AdapterError: no PEFT adapter folders (<agent>/adapter_config.json) under {tmp_path}" in err
    )


def test_the_command_profiles_on_scienceqa_text(tokenizer, monkeypatch, tmp_path):
    """End to end on a 2-layer random model with the SmolLM2 vocabulary, three random adapters in
    a folder: the file holds the profile of the ScienceQA calibration and says so."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model = model_from_hf(hf, tokenizer)
    dirs = {a: save_random_adapter(hf, tmp_path / a, seed=i + 1) for i, a in enumerate(AGENTS)}
    loaded = []
    monkeypatch.setattr(precache.models, "load_model", lambda path: loaded.append(path) or model)
    argv = ["adapters", "profile-droidspeak", "--benchmark", "scienceqa", "--adapters", str(tmp_path)]
    assert main([*argv, "--n-critical", "1"]) == 0
    assert loaded == [None]  # the embedded model by default
    stored = json.loads((tmp_path / PROFILE_FILE).read_text())
    adapters = {a: load_adapter(d, model.config, a) for a, d in dirs.items()}
    expected = profile(model, adapters, n_critical=1, calibration=calibration(tokenizer, "scienceqa"))
    assert stored["calibration"] == "scienceqa train[:4], at most 128 tokens each"
    assert stored["adapters"] == sorted(AGENTS) and stored["num_layers"] == 2
    assert stored["layer_errors"] == expected["layer_errors"] and all(e > 0 for e in stored["layer_errors"])
    assert (
        stored["layers"]
        == expected["layers"]
        == [stored["layer_errors"].index(max(stored["layer_errors"]))] * 2
    )
    hotpot = profile(model, adapters, n_critical=1, calibration=calibration(tokenizer, "hotpotqa"))
    assert hotpot["layer_errors"] != stored["layer_errors"]  # the benchmark's text made the difference
    assert read_profile(tmp_path / PROFILE_FILE, model, adapters)["layers"] == stored["layers"]


@pytest.mark.parametrize(
    ("folder", "made_with"),
    [
        (SCIENCEQA_ROOT / "qv", "scienceqa train[:4], at most 128 tokens each"),
        (ADAPTER_ROOT / "qv", None),  # written before the calibration was recorded: still read
        (ADAPTER_ROOT / "all", "hotpotqa train[:4], at most 128 tokens each"),
        (SCIENCEQA_ROOT / "all", "scienceqa train[:4], at most 128 tokens each"),
    ],
)
def test_committed_profiles_read(folder, made_with):
    smollm2 = SimpleNamespace(config=SimpleNamespace(num_layers=30))
    stored = read_profile(folder / PROFILE_FILE, smollm2, dict.fromkeys(AGENTS))
    assert stored.get("calibration") == made_with
    first, last = stored["layers"]
    assert last - first + 1 == 10 and len(stored["layer_errors"]) == 30
    window = [sum(stored["layer_errors"][a : a + 10]) for a in range(21)]
    assert first == window.index(max(window))  # the stored range is the stored errors' top window
