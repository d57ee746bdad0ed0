"""config.json fields that change the forward: honoured (logits equal HF on a tiny random model
with the field set) or refused at load with a ModelLoadError naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import precache
from precache.errors import ModelLoadError
from precache.models import ModelConfig, dense_logits, model_from_hf
from tests.tiny import _COMMON, peft_logits

TOL = 1e-4
IDS = torch.randint(0, 90, (48,), generator=torch.Generator().manual_seed(5)).tolist()
HALF = 8  # head_dim 16 -> 8 rotary frequencies


def _random_model(cfg, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return model


HONOURED = {
    "attention_bias+mlp_bias": lambda: LlamaConfig(**_COMMON, attention_bias=True, mlp_bias=True),
    "hidden_act=gelu_pytorch_tanh": lambda: LlamaConfig(**_COMMON, hidden_act="gelu_pytorch_tanh"),
    "hidden_act=relu": lambda: MistralConfig(**_COMMON, hidden_act="relu", sliding_window=None),
    "head_dim=32": lambda: LlamaConfig(**_COMMON, head_dim=32),
    "qwen2 head_dim=8": lambda: Qwen2Config(**_COMMON, head_dim=8, use_sliding_window=False),
    "tie_word_embeddings": lambda: LlamaConfig(**{**_COMMON, "tie_word_embeddings": True}),
    "rms_norm_eps=0.5": lambda: LlamaConfig(**{**_COMMON, "rms_norm_eps": 0.5}),
    "qwen3 attention_bias": lambda: Qwen3Config(
        **_COMMON, head_dim=16, attention_bias=True, use_sliding_window=False
    ),
    "rope_theta=50": lambda: LlamaConfig(
        **_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 50.0}
    ),
    "rope linear": lambda: LlamaConfig(
        **_COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0}
    ),
    "legacy rope_scaling": lambda: LlamaConfig(
        **_COMMON, rope_scaling={"type": "linear", "factor": 3.0}, rope_theta=200.0
    ),
    "rope dynamic": lambda: LlamaConfig(
        **_COMMON, rope_parameters={"rope_type": "dynamic", "rope_theta": 100.0, "factor": 4.0}
    ),
    "rope yarn": lambda: LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 100.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "rope proportional, partial": lambda: LlamaConfig(
        **_COMMON,
        rope_parameters={"rope_type": "proportional", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
    ),
    "rope longrope": lambda: LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 100.0,
            "short_factor": [1.0 + 0.3 * i for i in range(HALF)],
            "long_factor": [2.0 + 0.5 * i for i in range(HALF)],
            "original_max_position_embeddings": 64,
        },
    ),
}


@pytest.mark.parametrize("case", list(HONOURED))
def test_honoured_field_matches_hf(case):
    hf = _random_model(HONOURED[case]())
    ours = model_from_hf(hf)
    diff = (dense_logits(ours, [IDS])[0] - peft_logits(hf, None, IDS)).abs().max().item()
    assert diff <= TOL, f"{case}: max abs diff {diff}"


def test_honoured_fields_change_the_logits():
    """Each honoured case really differs from the plain model (a test that cannot fail is no test)."""
    plain = peft_logits(_random_model(LlamaConfig(**_COMMON)), None, IDS)
    for case in ("hidden_act=gelu_pytorch_tanh", "rms_norm_eps=0.5", "rope_theta=50", "rope linear"):
        other = peft_logits(_random_model(HONOURED[case]()), None, IDS)
        assert (other - plain).abs().max() > 1e-2, case


def _llama(**fields):
    cfg = LlamaConfig(**_COMMON)
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


def _qwen2(**fields):
    cfg = Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


REFUSED = {
    "quantization_config": (
        lambda: _llama(quantization_config={"quant_method": "gptq", "bits": 4}),
        "quantization_config \\(quant_method 'gptq'\\)",
    ),
    "hidden_act learnable": (lambda: _llama(hidden_act="xielu"), "hidden_act 'xielu' has learnable"),
    "hidden_act unknown": (lambda: _llama(hidden_act="swiglu2"), "hidden_act 'swiglu2' is unknown"),
    "partial_rotary_factor": (
        lambda: _llama(
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
        ),
        "partial_rotary_factor=0.5 is not supported with rope_type 'default'",
    ),
    "rope_type unknown": (
        lambda: _llama(rope_parameters={"rope_type": "su", "rope_theta": 1e4}),
        "rope_type 'su' is not supported",
    ),
    "rope per layer type": (
        lambda: _llama(
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e4},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
            }
        ),
        "rope_parameters per layer type",
    ),
    "layer type unknown": (
        lambda: _qwen2(layer_types=["full_attention", "chunked_attention"]),
        "layer_types\\[1\\] = 'chunked_attention' is not supported",
    ),
    "sliding layer without window": (
        lambda: _qwen2(sliding_window=None),
        "layer_types\\[1\\] is 'sliding_attention' but sliding_window is null",
    ),
    "layer_types length": (lambda: _qwen2(layer_types=["full_attention"]), "layer_types has 1 entries"),
    "sliding_window 0": (lambda: MistralConfig(**_COMMON, sliding_window=0), "sliding_window=0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_field_names_itself(case):
    make, message = REFUSED[case]
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf(make())


def test_quantized_checkpoint_is_refused_before_its_weights_load(tmp_path):
    """load_model reads config.json and refuses before touching the (here absent) weights."""
    folder = tmp_path / "m"
    folder.mkdir()
    cfg = LlamaConfig(**_COMMON).to_dict()
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quantization_config \\(quant_method 'awq'\\)"):
        precache.load_model(folder)


def test_dynamic_rope_context_stops_where_hf_recomputes_frequencies():
    """HF regrows dynamic-NTK frequencies past max_position_embeddings: cached keys cannot follow."""
    hf = _random_model(HONOURED["rope dynamic"]())
    assert model_from_hf(hf).max_context == hf.config.max_position_embeddings
    with pytest.raises(ModelLoadError, match="max_context=300 is past 256, where 'dynamic' RoPE"):
        model_from_hf(hf, max_context=300)


def test_longrope_context_stops_at_the_original_length():
    hf = _random_model(HONOURED["rope longrope"]())
    assert model_from_hf(hf).max_context == 64
    with pytest.raises(ModelLoadError, match="rope_type"):
        model_from_hf(hf, max_context=65)


def test_gguf_converted_folder_is_not_taken_for_quantized_weights():
    """transformers writes quant_method 'gguf' into a folder saved from a GGUF-loaded model (our
    conversions, the embedded model's included); its safetensors hold de-quantised floats."""
    cfg = _llama(quantization_config={"quant_method": "gguf", "gguf_file": "m.gguf", "dequantize": False})
    assert ModelConfig.from_hf(cfg).num_layers == 2
