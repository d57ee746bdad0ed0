"""load_model on HF folders and GGUF files, stop ids, and refusals of what it cannot load."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

import precache
from precache.errors import ModelLoadError
from precache.models import dense_logits, loader
from tests.tiny import peft_logits, tiny_hf_model

IDS = [5, 9, 33, 71, 2, 18, 40, 64]


def test_load_hf_folder_matches_the_saved_model(tmp_path):
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path / "m")
    model = precache.load_model(tmp_path / "m", require_tokenizer=False)
    assert model.config.model_type == "qwen2" and model.config.attention_bias and model.tokenizer is None
    assert (dense_logits(model, [IDS])[0] - peft_logits(hf, None, IDS)).abs().max() <= 1e-4


def test_bf16_forward_tracks_hf_bf16(tmp_path):
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path / "m")
    model = precache.load_model(tmp_path / "m", dtype=torch.bfloat16, require_tokenizer=False)
    assert model.dtype == torch.bfloat16
    ref = peft_logits(hf.to(torch.bfloat16), None, IDS)
    ours = dense_logits(model, [IDS])[0]
    assert (ours - ref).abs().max() <= 0.1 * ref.abs().max()  # bf16 has ~3 significant digits
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        precache.load_model(tmp_path / "nowhere")


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        precache.load_model(tmp_path / "m")


def test_unsupported_architecture(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "g")
    with pytest.raises(
        ModelLoadError, match=r"unknown model_type .gpt2. \(model_types: llama, mistral, qwen2, qwen3\)"
    ):
        precache.load_model(tmp_path / "g")


def test_malformed_config(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"})[:-3])
    with pytest.raises(ModelLoadError, match="config.json cannot be read"):
        precache.load_model(tmp_path / "m")


def test_folder_without_tokenizer_is_refused_at_load(tmp_path):
    """The issue's case: no tokenizer files used to fail later, at the first text, with a ValueError."""
    tiny_hf_model("llama").save_pretrained(tmp_path / "m")
    with pytest.raises(ModelLoadError, match="has no tokenizer .*require_tokenizer=False"):
        precache.load_model(tmp_path / "m")


def test_unreadable_tokenizer_is_refused_at_load(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer in .* cannot be read"):
        precache.load_model(tmp_path / "m")


@pytest.mark.parametrize("as_list", [False, True])
def test_generation_config_eos_stops_the_turn_as_hf_generate(tmp_path, as_list):
    """An EOS id listed only in generation_config.json (Llama-3's <|eot_id|> pattern) ends the turn:
    here it is the greedy next token, so the turn stops after one token, as HF generate does."""
    hf = tiny_hf_model("llama")
    prompt = IDS
    greedy = int(peft_logits(hf, None, prompt)[-1].argmax())
    other = (greedy + 1) % hf.config.vocab_size
    hf.config.eos_token_id = other  # config.json names another id
    hf.generation_config = GenerationConfig(
        eos_token_id=[other, greedy] if as_list else greedy, bos_token_id=1, do_sample=False
    )
    hf.save_pretrained(tmp_path / "m")
    stored = json.loads((tmp_path / "m" / "generation_config.json").read_text())["eos_token_id"]
    assert stored == ([other, greedy] if as_list else greedy)
    ref = precache_free_generate(tmp_path / "m", prompt)
    assert ref == [greedy]  # HF generate stops after the EOS token

    model = precache.load_model(tmp_path / "m", require_tokenizer=False)
    engine = precache.Engine(model, method="nonshared")
    assert greedy in engine.eos_token_ids and other in engine.eos_token_ids
    session = engine.session()
    session.append(prompt)
    turn = session.generate(max_new_tokens=5, temperature=0.0)
    assert turn.token_ids == ref and turn.stop_reason == "eos"


def precache_free_generate(folder, prompt: list[int]) -> list[int]:
    """HF generate's new tokens (greedy, up to 5) from a fresh load of ``folder``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _fake_gguf(path, content: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + content)
    return path


@pytest.fixture
def recorded_conversions(tmp_path, monkeypatch):
    """convert_gguf replaced by a recorder that writes a folder naming its source's content."""
    monkeypatch.setenv("PRECACHE_HOME", str(tmp_path / "home"))
    calls = []

    def fake_convert(gguf_file, out_dir, name=None):
        calls.append(gguf_file)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"source": gguf_file.read_bytes().decode()}))
        return out_dir

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    return calls


def _source(folder) -> str:
    return json.loads((folder / "config.json").read_text())["source"]


def test_two_gguf_files_with_one_name_get_their_own_conversions(tmp_path, recorded_conversions):
    """The issue's case: the conversion cache was keyed by file stem, so the second file of the
    same name got the first one's weights."""
    a = _fake_gguf(tmp_path / "a" / "model.gguf", b"weights of a")
    b = _fake_gguf(tmp_path / "b" / "model.gguf", b"weights of b")
    folder_a, folder_b = loader.resolve_checkpoint(a), loader.resolve_checkpoint(b)
    assert folder_a != folder_b
    assert _source(folder_a) == "GGUFweights of a" and _source(folder_b) == "GGUFweights of b"
    assert recorded_conversions == [a, b]


def test_gguf_conversion_is_reused_by_content_and_redone_when_the_file_changes(
    tmp_path, recorded_conversions
):
    a = _fake_gguf(tmp_path / "a" / "model.gguf", b"same bytes")
    copy = _fake_gguf(tmp_path / "elsewhere" / "renamed.gguf", b"same bytes")
    first = loader.resolve_checkpoint(a)
    assert loader.resolve_checkpoint(a) == first and len(recorded_conversions) == 1
    assert loader.resolve_checkpoint(copy) == first and len(recorded_conversions) == 1  # same content
    _fake_gguf(a, b"new bytes, new size")
    changed = loader.resolve_checkpoint(a)
    assert changed != first and _source(changed) == "GGUFnew bytes, new size"
    assert recorded_conversions[-1] == a


@pytest.mark.slow
def test_the_embedded_model_keeps_its_name_after_a_fresh_conversion(tmp_path, monkeypatch):
    """The conversion folder is named by a content hash; the model is still SmolLM2-135M-Instruct
    (the served model id, and what the committed adapters' base_model_name_or_path names)."""
    monkeypatch.setenv("PRECACHE_HOME", str(tmp_path))
    folder = loader.embedded_checkpoint()
    assert folder.name.startswith("gguf-")
    assert loader.checkpoint_name(folder) == "SmolLM2-135M-Instruct"
    other = loader.converted_checkpoint(loader.embedded_gguf_path())  # same content: the same folder
    assert other == folder and loader.checkpoint_name(other) == "SmolLM2-135M-Instruct"
