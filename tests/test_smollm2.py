"""The embedded SmolLM2-135M-Instruct: our forward and greedy decoding against HF transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import precache
from precache.models import dense_logits, embedded_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    model = precache.load_model()
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    return model, hf


def _prompt(model, n=64):
    text = (
        "The Eiffel Tower, located in Paris, France, was completed in 1889 for the World's Fair. "
        "It was designed by the engineering firm of Gustave Eiffel and has become a global icon. "
    ) * 3
    ids = model.tokenizer.encode(text, add_special_tokens=False)[:n]
    assert len(ids) == n
    return ids


def test_embedded_model_is_smollm2(smol):
    model, _ = smol
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert model.tokenizer.chat_template and "im_start" in model.tokenizer.chat_template


def test_loads_the_converted_safetensors_checkpoint(smol):
    model, _ = smol  # the GGUF is converted once; every later load reads this folder
    assert Path(model.path) == embedded_checkpoint()
    assert (Path(model.path) / "model.safetensors").is_file()


def test_logits_match_hf_on_64_tokens(smol):
    model, hf = smol
    ids = _prompt(model)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    diff = (dense_logits(model, [ids])[0] - ref).abs().max().item()
    assert diff <= 1e-4, diff


def test_greedy_32_tokens_match_hf_generate(smol):
    model, hf = smol
    tok = model.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Name three uses of a paperclip."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32)[0][
            len(ids) :
        ].tolist()
    engine = precache.Engine(model, method="nonshared")
    engine.eos_token_ids = frozenset()  # HF was told min_new_tokens=32
    s = engine.session()
    s.append(ids)
    turn = s.generate(max_new_tokens=32, temperature=0.0)
    assert turn.token_ids == ref
    assert turn.ttft_s > 0 and turn.decode_s > 0
