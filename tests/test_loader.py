"""load_model on HF folders and refusals of what it cannot load."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import precache
from precache.errors import ModelLoadError
from precache.models import dense_logits
from tests.tiny import peft_logits, tiny_hf_model

IDS = [5, 9, 33, 71, 2, 18, 40, 64]


def test_load_hf_folder_matches_the_saved_model(tmp_path):
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path / "m")
    model = precache.load_model(tmp_path / "m")
    assert model.config.model_type == "qwen2" and model.config.attention_bias
    assert (dense_logits(model, [IDS])[0] - peft_logits(hf, None, IDS)).abs().max() <= 1e-4


def test_bf16_forward_tracks_hf_bf16(tmp_path):
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path / "m")
    model = precache.load_model(tmp_path / "m", dtype=torch.bfloat16)
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
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        precache.load_model(tmp_path / "g")


def test_malformed_config(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"})[:-3])
    with pytest.raises(ModelLoadError, match="config.json cannot be read"):
        precache.load_model(tmp_path / "m")
