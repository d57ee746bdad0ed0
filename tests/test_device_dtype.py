"""Device and dtype plumbing: a bf16 model puts its adapters and block pool in bf16, and an engine
over it gives the fp32 engine's logits within bf16 tolerance (the GPU default is bf16; on CPU
the same code path runs with ``device="cpu"``)."""

from __future__ import annotations

import copy

import pytest
import torch

from precache.models import model_from_hf
from tests.tiny import AGENTS, make_engine, save_random_adapter, tiny_hf_model


@pytest.mark.parametrize("method", ["prelrshared", "rebaseshared-db", "nonshared"])
def test_bf16_engine_matches_fp32_within_bf16_tolerance(tmp_path, method):
    hf = tiny_hf_model("llama", seed=4, num_layers=2)
    targets = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("v_proj", "down_proj")]
    dirs = {
        a: save_random_adapter(hf, tmp_path / a, targets=t, r=r, seed=i + 1)
        for i, (a, t, r) in enumerate(zip(AGENTS, targets, (3, 8, 5), strict=True))
    }
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (14, 6, 9, 5)]
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = model_from_hf(copy.deepcopy(hf).to(dtype), device="cpu")
        engine = make_engine(model, dirs, method, attention_backend="torch")
        assert engine.pool.k.dtype == dtype and engine.pool.k.device.type == "cpu"
        assert all(
            w.dtype == dtype for ad in engine.adapters.values() for pair in ad.weights.values() for w in pair
        )
        session = engine.session()
        session.append(ids[0])
        turns = []
        for agent, forced in zip(("plan", "action", "reflect"), ids[1:], strict=True):
            turns.append(session.teacher_force(agent, forced))
        logits[dtype] = torch.cat([t.logits for t in turns])
    ref, got = logits[torch.float32], logits[torch.bfloat16]
    assert got.dtype == torch.float32 and got.shape == ref.shape
    scale = ref.abs().max()
    err = (got - ref).abs().max()
    assert err > 0  # bf16 really ran
    assert err < 0.05 * scale, (err, scale)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_default_attention_backend_is_triton_on_cuda_and_torch_on_cpu():
    from precache.cache.attention import default_backend, triton_available

    assert default_backend("cpu") == default_backend(None) == "torch"
    assert default_backend("cuda:0") == ("triton" if triton_available() else "torch")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        make_engine(
            model_from_hf(tiny_hf_model("llama", seed=1, num_layers=1)),
            {},
            "prelrshared",
            attention_backend="flash",
        )
