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
from precache.models.layers import linear
from precache.models.llama import LlamaModel
from precache.models.quant import INT4_GROUP_SIZE, INT8_KERNEL_MAX_ROWS, QUANTIZATIONS, Int4Weight, Int8Weight
from tests.tiny import AGENTS, make_engine, save_random_adapter, tiny_hf_model, tiny_model


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


def test_int4_weight_is_group_wise_asymmetric_with_bf16_scales_and_zeros():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 2 * INT4_GROUP_SIZE, generator=gen) * torch.linspace(0.01, 3, 48)[:, None]
    w[3, :INT4_GROUP_SIZE] = 0.7  # a constant group: zero range, a positive scale, exact
    q = Int4Weight.quantize(w)
    assert q.shape == w.shape and q.qweight.min() >= 0 and q.qweight.max() <= 15
    assert q.scales_and_zeros.shape == (2, 48, 2) and q.scales_and_zeros.dtype == torch.bfloat16
    groups = w.view(48, 2, INT4_GROUP_SIZE)
    scales = ((groups.amax(-1) - groups.amin(-1)) / 15).to(torch.bfloat16).float()
    got_scales = q.scales_and_zeros[..., 0].float().T  # [48, 2]
    assert torch.equal(got_scales[scales > 0], scales[scales > 0])
    deq = q.dequantize()
    # each entry within half a step of its group's scale (plus the bf16 rounding of the zero)
    step = got_scales.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    zero_rounding = (q.scales_and_zeros[..., 1].float().T.abs() * 2**-8).repeat_interleave(INT4_GROUP_SIZE, 1)
    assert torch.all((deq - w).abs() <= step / 2 + zero_rounding + 1e-6)
    assert torch.allclose(deq[3, :INT4_GROUP_SIZE], torch.tensor(0.7), atol=0.7 * 2**-8)
    assert q.nbytes() == 48 * 2 * INT4_GROUP_SIZE // 2 + 2 * 2 * 48 * 2
    with pytest.raises(ValueError, match="int4 needs d_in a multiple of 32; a 4 x 80 weight is not"):
        Int4Weight.quantize(torch.randn(4, 80))
    model, _ = tiny_model("llama", num_layers=1, intermediate_size=80)  # down_proj's d_in
    with pytest.raises(
        ValueError,
        match=r"int4 needs every projection's d_in a multiple of 32; layers.0.down_proj is 64 x 80",
    ):
        model.quantize("int4")
    assert model.quantization is None and not isinstance(model.layers[0]["qkv"], Int4Weight)


@pytest.mark.parametrize("rows", [1, 5, INT8_KERNEL_MAX_ROWS + 1])
def test_int4_product_is_the_product_with_the_dequantized_weight(rows):
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 128, generator=gen), torch.randn(rows, 128, generator=gen)
    q = Int4Weight.quantize(w)
    got = linear(x, q)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    if rows <= INT8_KERNEL_MAX_ROWS:  # the int4 kernel: bf16 inputs and output
        ref = x.to(torch.bfloat16).float() @ q.dequantize().T
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    else:
        torch.testing.assert_close(got, x @ q.dequantize().T, rtol=1e-5, atol=1e-5)
    # int4's error against the fp32 weight: larger than int8's, still a fraction of the outputs
    err = (got - x @ w.T).abs().max() / (x @ w.T).abs().max()
    assert 0.005 < err < 0.2, err


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


#: each precision's logits against fp32's (relative to the largest) and greedy top-1 agreement
#: on this tiny model (docs/performance.md, "Precision on CPU"): bound and floor. Measured over the three
#: methods: int8 0.017-0.022 with top-1 0.95; int4 (4 bits in groups of 32 over the wide random
#: weights, the LM head int8) 0.30-0.46 with top-1 0.70-0.95
ERRORS = {"int8": (0.05, 0.9), "int4": (0.6, 0.6)}


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("method", ["prelrshared", "rebaseshared-db", "nonshared"])
def test_quantized_engine_matches_fp32_references(tmp_path, method, quantization):
    hf = tiny_hf_model("llama", seed=4, num_layers=2)
    dirs = _adapters(hf, tmp_path)
    fp32 = model_from_hf(copy.deepcopy(hf))
    quantized = model_from_hf(copy.deepcopy(hf))
    quantized.quantize(quantization)
    kind = Int8Weight if quantization == "int8" else Int4Weight
    assert quantized.quantization == quantization and quantized.dtype == torch.float32
    assert all(isinstance(w[name], kind) for w in quantized.layers for name in LlamaModel.QUANTIZED)
    assert isinstance(quantized.lm_head, Int8Weight)  # int8 under int4 too
    dequantized = model_from_hf(copy.deepcopy(hf))  # the quantized weights, held in fp32
    for w, wq in zip(dequantized.layers, quantized.layers, strict=True):
        for name in LlamaModel.QUANTIZED:
            w[name] = wq[name].dequantize()
    dequantized.lm_head = quantized.lm_head.dequantize()
    got, same_weights, ref = (_logits(m, dirs, method) for m in (quantized, dequantized, fp32))
    scale = ref.abs().max()
    # the products' inputs (and int4's outputs) rounded to bf16: the only difference from the
    # dequantized fp32 model
    assert (got - same_weights).abs().max() < 0.02 * scale
    # the quantization error against the original weights (stated in docs/performance.md, "Precision on CPU")
    bound, agreement = ERRORS[quantization]
    err = (got - ref).abs().max()
    assert 0 < err < bound * scale, (err, scale)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= agreement


def test_quantization_refused_where_precache_does_not_run_it(tmp_path):
    import precache
    from precache.cli_args import QUANTIZATIONS as CLI_QUANTIZATIONS

    assert CLI_QUANTIZATIONS == QUANTIZATIONS
    tiny_hf_model("llama", seed=0, num_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="quantization 'int2': precache runs int8, int4 only"):
        precache.load_model(tmp_path, quantization="int2", require_tokenizer=False)
    with pytest.raises(ModelLoadError, match="quantization 'int4' runs on the CPU only, not on cuda"):
        precache.load_model(tmp_path, quantization="int4", device="cuda", require_tokenizer=False)
    with pytest.raises(ModelLoadError, match="runs on the CPU only, not on cuda"):
        precache.load_model(tmp_path, quantization="int8", device="cuda", require_tokenizer=False)
    model = precache.load_model(tmp_path, quantization="int8", require_tokenizer=False)
    assert isinstance(model.lm_head, Int8Weight) and model.embed.dtype == torch.float32


def test_every_model_command_takes_quantization(capsys):
    from precache.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--quantization", "int2"])
    assert exit_.value.code == 2 and "invalid choice: 'int2'" in capsys.readouterr().err
    for command in (["serve"], ["bench", "trace"], ["eval"], ["fidelity"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        assert "--quantization {int8,int4}" in capsys.readouterr().out, command
