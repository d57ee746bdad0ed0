"""int8 weight-only weights on a CPU (precache/models/quant.py): the quantization formula, the
kernel's product against the dequantized weight, and engines over an int8 model against two fp32
references: the same dequantized weights (only the bf16 rounding of the products' inputs differs)
and the original weights (the quantization error itself)."""

from __future__ import annotations

import copy

import pytest
import torch

from precache.errors import ModelLoadError
from precache.models import model_from_hf
from precache.models.llama import LlamaModel, linear
from precache.models.quant import INT8_KERNEL_MAX_ROWS, QUANTIZATIONS, Int8Weight
from tests.tiny import AGENTS, make_engine, save_random_adapter, tiny_hf_model


def test_int8_weight_is_per_row_symmetric_with_bf16_scales():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen) * torch.linspace(0.01, 3, 48)[:, None]
    w[5] = 0.0  # an all-zero row keeps a positive scale and dequantizes to zeros
    q = Int8Weight.quantize(w)
    assert q.qweight.dtype == torch.int8 and q.scales.dtype == torch.bfloat16 and q.shape == w.shape
    scales = (w.abs().amax(1) / 127).to(torch.bfloat16).float()
    assert torch.equal(q.scales[torch.arange(48) != 5].float(), scales[torch.arange(48) != 5])
    want = torch.round(w / q.scales.float()[:, None]).clamp(-127, 127)
    assert torch.equal(q.qweight.float(), want)
    assert q.qweight.abs().max() <= 127 and torch.all(q.dequantize()[5] == 0)
    # each entry within half a step of its row's scale
    assert torch.all((q.dequantize() - w).abs() <= q.scales.float()[:, None] / 2 + 1e-7)
    assert q.nbytes() == 48 * 40 + 2 * 48


@pytest.mark.parametrize("rows", [1, 3, 70, INT8_KERNEL_MAX_ROWS + 1])
def test_int8_product_is_the_product_with_the_dequantized_weight(rows):
    gen = torch.Generator().manual_seed(rows)
    w, x, bias = torch.randn(96, 64, generator=gen), torch.randn(rows, 64, generator=gen), torch.randn(96)
    q = Int8Weight.quantize(w)
    got = linear(x, q, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    if rows <= INT8_KERNEL_MAX_ROWS:  # the int8 kernel: bf16 inputs, fp32 accumulation
        ref = x.to(torch.bfloat16).float() @ q.dequantize().T + bias
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    else:  # prefill: the dequantized weight at the compute dtype
        torch.testing.assert_close(got, x @ q.dequantize().T + bias, rtol=1e-5, atol=1e-5)
    # and the quantization error against the fp32 weight stays small relative to the outputs
    assert (got - (x @ w.T + bias)).abs().max() < 0.05 * (x @ w.T).abs().max()


def _adapters(hf, tmp_path):
    targets = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("v_proj", "down_proj")]
    return {
        a: save_random_adapter(hf, tmp_path / a, targets=t, r=r, seed=i + 1)
        for i, (a, t, r) in enumerate(zip(AGENTS, targets, (3, 8, 5), strict=True))
    }


def _logits(model, dirs, method) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (14, 6, 9, 5)]
    engine = make_engine(model, dirs, method, attention_backend="torch")
    session = engine.session()
    session.append(ids[0])
    turns = [session.teacher_force(a, f) for a, f in zip(("plan", "action", "reflect"), ids[1:], strict=True)]
    return torch.cat([t.logits for t in turns])


@pytest.mark.parametrize("method", ["prelrshared", "rebaseshared-db", "nonshared"])
def test_int8_engine_matches_fp32_references(tmp_path, method):
    hf = tiny_hf_model("llama", seed=4, num_layers=2)
    dirs = _adapters(hf, tmp_path)
    fp32 = model_from_hf(copy.deepcopy(hf))
    int8 = model_from_hf(copy.deepcopy(hf))
    int8.quantize("int8")
    assert int8.quantization == "int8" and int8.dtype == torch.float32
    assert all(isinstance(w[name], Int8Weight) for w in int8.layers for name in LlamaModel.QUANTIZED)
    dequantized = model_from_hf(copy.deepcopy(hf))  # the int8 weights, held in fp32
    for w, wq in zip(dequantized.layers, int8.layers, strict=True):
        for name in LlamaModel.QUANTIZED:
            w[name] = wq[name].dequantize()
    dequantized.lm_head = int8.lm_head.dequantize()
    got, same_weights, ref = (_logits(m, dirs, method) for m in (int8, dequantized, fp32))
    scale = ref.abs().max()
    # the products' inputs rounded to bf16: the only difference from the dequantized fp32 model
    assert (got - same_weights).abs().max() < 0.02 * scale
    # the quantization error against the original weights (stated in README, "Precision on CPU")
    err = (got - ref).abs().max()
    assert 0 < err < 0.05 * scale, (err, scale)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_quantization_refused_where_precache_does_not_run_it(tmp_path):
    import precache
    from precache.cli_args import QUANTIZATIONS as CLI_QUANTIZATIONS

    assert CLI_QUANTIZATIONS == QUANTIZATIONS
    tiny_hf_model("llama", seed=0, num_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="quantization 'int4': precache runs int8 only"):
        precache.load_model(tmp_path, quantization="int4", require_tokenizer=False)
    with pytest.raises(ModelLoadError, match="runs on the CPU only, not on cuda"):
        precache.load_model(tmp_path, quantization="int8", device="cuda", require_tokenizer=False)
    model = precache.load_model(tmp_path, quantization="int8", require_tokenizer=False)
    assert isinstance(model.lm_head, Int8Weight) and model.embed.dtype == torch.float32


def test_every_model_command_takes_quantization(capsys):
    from precache.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--quantization", "int4"])
    assert exit_.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    for command in (["serve"], ["bench", "trace"], ["eval"], ["fidelity"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        assert "--quantization {int8}" in capsys.readouterr().out, command
