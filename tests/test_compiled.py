"""The compiled one-token forward (``compile_decode``, :mod:`precache.models.compiled`) against the
eager forward: the same logits up to float rounding, the same greedy tokens, through the engine's
caches, for adapters it compiles and adapters whose layers fall back to eager."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

from precache.errors import ModelLoadError
from precache.models import model_from_hf
from precache.models.compiled import DecodeBlocks
from tests.tiny import AGENTS, make_engine, save_random_adapter, tiny_hf_model

# plan: q and v (compiled); action: o_proj too, reflect: down_proj (their layers run eager)
TARGETS = {
    "plan": ("q_proj", "v_proj"),
    "action": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "reflect": ("v_proj", "down_proj"),
}


def _adapters(hf, tmp_path):
    return {
        agent: save_random_adapter(hf, tmp_path / agent, targets=TARGETS[agent], r=(3, 8, 5)[i], seed=i + 1)
        for i, agent in enumerate(AGENTS)
    }


def _replay(model, dirs, method):
    """One-token teacher-forced steps and greedy turns of every agent: (logits, tokens)."""
    engine = make_engine(model, dirs, method, attention_backend="torch")
    session = engine.session()
    gen = torch.Generator().manual_seed(7)
    session.append(torch.randint(0, 90, (12,), generator=gen).tolist())
    logits, tokens = [], []
    for agent in ("plan", "action", "reflect", "plan"):
        for _ in range(2):
            logits.append(
                session.teacher_force(agent, [int(torch.randint(0, 90, (1,), generator=gen))]).logits
            )
        tokens.append(session.generate(agent=agent, max_new_tokens=3, temperature=0.0).token_ids)
        session.append(torch.randint(0, 90, (3,), generator=gen).tolist())
    return torch.cat(logits), tokens


@pytest.mark.parametrize(
    ("kind", "method"), [("llama", "prelrshared"), ("llama", "nonshared"), ("qwen2", "fullshared")]
)
def test_compiled_decode_matches_the_eager_forward(tmp_path, monkeypatch, kind, method):
    hf = tiny_hf_model(kind, seed=4, num_layers=2)  # qwen2: q/k/v biases
    dirs = _adapters(hf, tmp_path)
    eager = model_from_hf(copy.deepcopy(hf))
    compiled = model_from_hf(copy.deepcopy(hf))
    compiled.compile_decode()
    ran = {"compiled": 0, "eager": 0}
    after = DecodeBlocks.after_attention

    def counting(self, x, attn, layer):
        ran["compiled"] += 1
        return after(self, x, attn, layer)

    monkeypatch.setattr(DecodeBlocks, "after_attention", counting)
    mlp = type(compiled)._mlp

    def counting_mlp(self, x, i, groups):
        if self is compiled:
            ran["eager"] += 1
        return mlp(self, x, i, groups)

    monkeypatch.setattr(type(compiled), "_mlp", counting_mlp)
    got_logits, got_tokens = _replay(compiled, dirs, method)
    ref_logits, ref_tokens = _replay(eager, dirs, method)
    assert ran["compiled"] > 0 and ran["eager"] > 0  # both paths ran: plan compiled, reflect eager
    assert got_tokens == ref_tokens
    assert torch.allclose(got_logits, ref_logits, atol=1e-4, rtol=1e-4), (got_logits - ref_logits).abs().max()


def test_compiled_decode_in_bf16_tracks_the_eager_bf16_forward(tmp_path):
    hf = tiny_hf_model("llama", seed=4, num_layers=2)
    dirs = _adapters(hf, tmp_path)
    hf = hf.to(torch.bfloat16)
    eager = model_from_hf(copy.deepcopy(hf))
    compiled = model_from_hf(copy.deepcopy(hf))
    compiled.compile_decode()
    assert compiled.dtype == torch.bfloat16
    got_logits, got_tokens = _replay(compiled, dirs, "prelrshared")
    ref_logits, ref_tokens = _replay(eager, dirs, "prelrshared")
    assert got_tokens == ref_tokens
    # bf16 keeps ~3 significant digits; fused loops round at other points than eager kernels
    assert (got_logits - ref_logits).abs().max() <= 0.05 * ref_logits.abs().max()


def test_compile_decode_refused_where_it_does_not_run(tmp_path):
    import precache

    tiny_hf_model("llama", seed=0, num_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="compile_decode multiplies dense weights, not int8 ones"):
        precache.load_model(tmp_path, quantization="int8", compile_decode=True, require_tokenizer=False)
    with pytest.raises(ModelLoadError, match="compile_decode runs on the CPU only, not on cuda"):
        precache.load_model(tmp_path, device="cuda", compile_decode=True, require_tokenizer=False)
    model = precache.load_model(tmp_path, compile_decode=True, require_tokenizer=False)
    assert isinstance(model.decode_blocks, DecodeBlocks)


def test_every_model_command_takes_compile_decode(capsys):
    from precache.cli import main
    from precache.cli_args import add_dtype_argument, model_options

    for command in (["serve"], ["bench", "trace"], ["bench", "decode"], ["eval"], ["fidelity"], ["run"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        assert "--compile-decode" in capsys.readouterr().out, command
    parser = argparse.ArgumentParser()
    add_dtype_argument(parser)
    assert model_options(parser.parse_args(["--compile-decode"])) == {
        "dtype": None,
        "quantization": None,
        "compile_decode": True,
    }
