"""Our forward against HF transformers and PEFT (the numerical oracle), fp32, max abs diff <= 1e-4."""

from __future__ import annotations

import pytest
import torch

from precache.lora.adapter import load_adapter
from precache.models import dense_logits
from tests.tiny import ALL_PROJ, peft_logits, save_random_adapter, tiny_model

TOL = 1e-4
IDS = [3, 17, 42, 5, 88, 61, 9, 23, 77, 14, 50, 2, 95, 31, 40, 66, 8, 12, 70, 44]


@pytest.mark.parametrize("kind", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_base_forward_matches_hf(kind):
    ours, hf = tiny_model(kind)
    diff = (dense_logits(ours, [IDS])[0] - peft_logits(hf, None, IDS)).abs().max().item()
    assert diff <= TOL, f"{kind}: max abs diff {diff}"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "targets,r,rslora",
    [
        (("q_proj", "v_proj"), 4, False),
        (("k_proj", "v_proj"), 8, False),
        (tuple(ALL_PROJ), 2, False),
        (tuple(ALL_PROJ), 6, True),
    ],
)
def test_adapter_forward_matches_peft(tmp_path, kind, targets, r, rslora):
    ours, hf = tiny_model(kind)
    path = save_random_adapter(hf, tmp_path / "a", targets=targets, r=r, alpha=2 * r + 1, use_rslora=rslora)
    adapter = load_adapter(path, ours.config)
    assert adapter.rank == r and adapter.targets == frozenset(targets)
    ref = peft_logits(hf, path, IDS)
    assert (ref - peft_logits(hf, None, IDS)).abs().max() > 1e-2, "the adapter must change the logits"
    diff = (dense_logits(ours, [IDS], [adapter])[0] - ref).abs().max().item()
    assert diff <= TOL, f"{kind} {targets} r={r}: max abs diff {diff}"


def test_mixed_adapter_batch_equals_rows_alone(tmp_path):
    ours, hf = tiny_model("llama")
    a = load_adapter(save_random_adapter(hf, tmp_path / "a", targets=ALL_PROJ, r=4, seed=1), ours.config)
    b = load_adapter(
        save_random_adapter(hf, tmp_path / "b", targets=("k_proj", "v_proj"), r=8, seed=2), ours.config
    )
    seqs = [IDS, IDS[:7], IDS[3:15], IDS, IDS[2:9]]
    adapters = [a, None, b, b, a]  # b's rows adjacent (one slice), a's apart (gathered)
    batched = dense_logits(ours, seqs, adapters)
    for seq, adapter, got in zip(seqs, adapters, batched, strict=True):
        alone = dense_logits(ours, [seq], [adapter])[0]
        assert torch.allclose(got, alone, atol=1e-5), adapter.name if adapter else None
    assert (batched[0] - batched[3]).abs().max() > 1e-2  # rows with different adapters really differ


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 64, 300])
@pytest.mark.parametrize(("d_out", "d_in"), [(960, 576), (3072, 576), (576, 1536), (10, 6), (7, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_thread_split_linear_equals_f_linear(rows, d_out, d_in, bias):
    """The CPU fp32 projection split over the torch threads (a batched product over slices of the
    output rows) against ``F.linear``: float rounding only (relative 1e-6); an odd ``d_out`` that
    does not split keeps ``F.linear`` itself."""
    from precache.models.layers import linear

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(rows * d_out + d_in)
        x, w = torch.randn(rows, d_in, generator=gen), torch.randn(d_out, d_in, generator=gen)
        b = torch.randn(d_out, generator=gen) if bias else None
        want = torch.nn.functional.linear(x, w, b)
        got = linear(x, w, b)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
        if d_out % 2:
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)
