"""Sliding-window attention (Mistral: every layer; Qwen2/Qwen3: the ``sliding_attention`` layers)
against HF transformers, in the dense forward and in every sharing method, on prompts several
times longer than the window and turns that decode past it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

from precache.methods import METHODS
from precache.models import dense_logits, model_from_hf
from tests.test_methods import check_turn_against_reference
from tests.tiny import _COMMON, AGENTS, make_engine, peft_logits, run_script, save_random_adapter

TOL = 1e-4
IDS = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(11)).tolist()
# 20 prompt tokens, then turns of 4-8 tokens: 68 tokens in all, more than eleven windows of 6
SCRIPT = [
    ("append", 20),
    ("plan", 5),
    ("append", 9),
    ("action", 6),
    ("append", 7),
    ("reflect", 5),
    ("append", 4),
    ("plan", 8),
    ("action", 4),
]


def windowed_hf_model(kind: str, window: int | None, num_layers: int = 3, seed: int = 0):
    """A tiny random HF model whose attention slides: ``mistral`` (every layer), ``qwen2`` /
    ``qwen3`` (layer 0 full, the others sliding, via ``max_window_layers = 1``). The weights
    depend only on ``seed``: ``window=None`` is the same model without a window."""
    common = {**_COMMON, "num_hidden_layers": num_layers}
    if kind == "mistral":
        cfg = MistralConfig(**common, sliding_window=window)
    else:
        cls, extra = (Qwen2Config, {}) if kind == "qwen2" else (Qwen3Config, {"head_dim": 16})
        cfg = cls(
            **common,
            **extra,
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=1,
        )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    "kind,window,expected",
    [("mistral", 8, (8, 8, 8)), ("qwen2", 5, (None, 5, 5)), ("qwen3", 7, (None, 7, 7))],
)
def test_dense_forward_matches_hf_with_a_window(kind, window, expected):
    """The issue's case: a 40-token prompt over a window of 8 (logits were 1.33 off)."""
    hf = windowed_hf_model(kind, window)
    ours = model_from_hf(hf)
    assert ours.config.layer_windows == expected
    ref = peft_logits(hf, None, IDS)
    unwindowed = peft_logits(windowed_hf_model(kind, None), None, IDS)
    assert (ref - unwindowed).abs().max() > 1e-2, "the window must change the logits"
    diff = (dense_logits(ours, [IDS])[0] - ref).abs().max().item()
    assert diff <= TOL, f"{kind}: max abs diff {diff}"


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed(request, tmp_path_factory):
    """``(kind, our model, hf model, adapters, zero-B adapters)``, windows of 6 tokens."""
    hf = windowed_hf_model(request.param, 6)
    root = tmp_path_factory.mktemp(f"win-{request.param}")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    dirs = {
        a: save_random_adapter(hf, root / a, targets=targets, r=r, seed=i + 1)
        for i, (a, r) in enumerate(zip(AGENTS, (4, 8, 2), strict=True))
    }
    zero = {
        a: save_random_adapter(hf, root / f"zero-{a}", targets=targets, r=4, seed=i + 7, zero_b=True)
        for i, a in enumerate(AGENTS)
    }
    return request.param, model_from_hf(hf), hf, dirs, zero


def _record_turn_starts(starts: list[int]):
    def on_turn(s, agent):
        starts.append(len(s.token_ids))

    return on_turn


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_hf_past_the_window(windowed, method):
    """Zero-B adapters: every method is the base model, so every turn's first logits and greedy
    tokens equal HF's over the whole trajectory, prefill and decode past the window alike."""
    _, model, hf, _, zero = windowed
    starts: list[int] = []
    s, turns = run_script(make_engine(model, zero, method), SCRIPT, on_turn=_record_turn_starts(starts))
    ref = peft_logits(hf, None, s.token_ids)  # [n, vocab]
    assert len(s.token_ids) == 68
    for n_before, turn in zip(starts, turns, strict=True):
        assert (turn.first_logits - ref[n_before - 1]).abs().max() <= TOL
        predicted = ref[n_before - 1 : n_before - 1 + len(turn.token_ids)].argmax(-1).tolist()
        assert turn.token_ids == predicted


def test_nonshared_equals_peft_past_the_window(windowed):
    """Non-zero adapters: NonShared's turns equal HF + PEFT with the agent's adapter."""
    _, model, hf, dirs, _ = windowed
    starts, agents = [], []

    def on_turn(s, agent):
        starts.append(len(s.token_ids))
        agents.append(agent)

    s, turns = run_script(make_engine(model, dirs, "nonshared"), SCRIPT, on_turn=on_turn)
    for n_before, agent, turn in zip(starts, agents, turns, strict=True):
        ref = peft_logits(hf, dirs[agent], s.token_ids[:n_before])[-1]
        assert (turn.first_logits - ref).abs().max() <= TOL


@pytest.mark.parametrize("method", METHODS)
def test_every_method_matches_the_windowed_brute_force_reference(windowed, method):
    """Non-zero adapters: each turn equals a brute-force forward over the agent's materialised view
    with the window mask (tests/reference.py), for every method's own cache layout."""
    _, model, _, dirs, _ = windowed
    _, turns = run_script(
        make_engine(model, dirs, method), SCRIPT, on_turn=check_turn_against_reference(method)
    )
    assert [len(t.token_ids) for t in turns] == [5, 6, 5, 8, 4]
