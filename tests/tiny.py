"""Tiny random Llama-family models and random PEFT adapters: the fixtures of the unit tests."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import precache
from precache.models import model_from_hf

_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attn_implementation="eager",
)
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_hf_config(kind: str = "llama"):
    """Config of a tiny random model: ``llama``, ``llama3`` (llama3 RoPE scaling), ``mistral``,
    ``qwen2`` (q/k/v bias) or ``qwen3`` (q/k norm)."""
    if kind == "llama":
        return LlamaConfig(**_COMMON)
    if kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(**_COMMON, rope_parameters=rope)
    if kind == "mistral":
        return MistralConfig(**_COMMON, sliding_window=None)
    if kind == "qwen2":
        return Qwen2Config(**_COMMON, use_sliding_window=False)
    if kind == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=16, use_sliding_window=False)
    raise ValueError(kind)


def tiny_hf_model(kind: str = "llama", seed: int = 0, num_layers: int | None = None, **overrides):
    """A random HF model whose every weight (biases and norms included) is non-trivial;
    ``overrides`` set config fields (``max_position_embeddings=4400``)."""
    torch.manual_seed(seed)
    cfg = tiny_hf_config(kind)
    if num_layers:
        cfg.num_hidden_layers = num_layers
    for key, value in overrides.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


def tiny_model(kind: str = "llama", seed: int = 0, num_layers: int | None = None, **overrides):
    """``(our model, hf model)`` sharing the same random weights."""
    hf = tiny_hf_model(kind, seed, num_layers, **overrides)
    return model_from_hf(hf), hf


def save_random_adapter(
    hf_model,
    path: Path,
    targets=("q_proj", "v_proj"),
    r: int = 4,
    alpha: int = 8,
    seed: int = 1,
    scale: float = 0.3,
    use_rslora: bool = False,
    zero_b: bool = False,
) -> Path:
    """Save a PEFT LoRA adapter with random non-zero A and B (or B = 0) for ``hf_model``."""
    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(copy.deepcopy(hf_model), cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(scale * torch.randn_like(p))
            elif "lora_B" in name:
                p.copy_(torch.zeros_like(p) if zero_b else scale * torch.randn_like(p))
    peft_model.save_pretrained(str(path))
    return path


def peft_logits(hf_model, adapter_dir: Path | None, ids: list[int]) -> torch.Tensor:
    """Oracle: HF (+ PEFT) logits ``[len(ids), vocab]`` of one sequence."""
    model = (
        hf_model
        if adapter_dir is None
        else PeftModel.from_pretrained(copy.deepcopy(hf_model), str(adapter_dir))
    )
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


AGENTS = ("plan", "action", "reflect")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float accumulation order: decode steps and batched references sum differently."""
    return torch.allclose(a, b, atol=1e-4, rtol=1e-4)


# (what, argument): append n fresh tokens, or a greedy turn of an agent with max_new_tokens
SCRIPT = [
    ("append", 12),
    ("plan", 4),
    ("append", 5),
    ("action", 3),
    ("append", 4),
    ("reflect", 3),
    ("append", 3),
    ("plan", 3),
    ("action", 2),
]


def make_engine(model, dirs, method, **options):
    engine = precache.Engine(model, adapters=dirs, method=method, **options)
    engine.eos_token_ids = frozenset()  # fixed turn lengths: no early EOS on a random model
    return engine


def run_script(engine, script=SCRIPT, on_turn=None):
    """Replay ``script``; return the turns. ``on_turn(session, agent, before)`` is called before a
    turn and returns a callback taking the turn."""
    s = engine.session()
    gen = torch.Generator().manual_seed(123)
    turns = []
    for what, n in script:
        if what == "append":
            s.append(torch.randint(0, 90, (n,), generator=gen).tolist())
            continue
        after = on_turn(s, what) if on_turn else None
        turn = s.generate(agent=what, max_new_tokens=n, temperature=0.0)
        turns.append(turn)
        s.check()
        if after:
            after(turn)
    return s, turns
