"""``kv_cache_dtype``: the block pool in another dtype than the model (vLLM's option of that name).
An fp32 model with a bf16 pool against the same model with an fp32 pool, for every method: the
pool holds bf16 entries (half the bytes for the same blocks), every read widens them, and the
teacher-forced logits differ only by the entries' rounding (docs/performance.md, "KV-cache dtype")."""

from __future__ import annotations

import pytest
import torch

from precache.methods import METHODS
from precache.models.quant import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from tests.tiny import make_engine, tiny_model

#: logits with a 16-bit pool against an fp32 pool, relative to the largest logit: each entry is
#: rounded once (relative error up to 2^-9 in bf16, 2^-12 in fp16). The tiny model's wide random
#: weights amplify it: measured 0.020-0.143 (bf16) and 0.005-0.015 (fp16) over the methods
CACHE_LOGITS = {"bfloat16": 0.25, "float16": 0.03}


def test_kv_cache_dtype_names_resolve_and_others_are_refused():
    assert resolve_kv_cache_dtype(None, torch.float32) is torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) is torch.bfloat16
    assert resolve_kv_cache_dtype("fp16", torch.float32) is torch.float16
    assert resolve_kv_cache_dtype(torch.bfloat16, torch.float32) is torch.bfloat16
    assert set(KV_CACHE_DTYPES.values()) == {torch.float32, torch.bfloat16, torch.float16}
    for bad in ("fp8", "int8", torch.int8, 16, ""):
        with pytest.raises(
            ValueError, match=r"kv_cache_dtype .* is not supported \(supported: auto, float32"
        ):
            resolve_kv_cache_dtype(bad, torch.float32)


def _logits(engine) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (14, 6, 9, 5, 7)]
    session = engine.session()
    session.append(ids[0])
    agents = ("plan", "action", "reflect", "plan")
    turns = [session.teacher_force(a, f) for a, f in zip(agents, ids[1:], strict=True)]
    return torch.cat([t.logits for t in turns]).float()


@pytest.mark.parametrize("method", METHODS)
def test_a_16_bit_pool_under_an_fp32_model_for_every_method(tiny, method):
    model, dirs, _ = tiny
    ref_engine = make_engine(model, dirs, method)
    ref = _logits(ref_engine)
    scale = ref.abs().max()
    errors = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        engine = make_engine(model, dirs, method, kv_cache_dtype=name)
        pool, ref_pool = engine.pool, ref_engine.pool
        assert pool.k.dtype == pool.v.dtype == pool.lr.dtype == dtype and ref_pool.k.dtype == torch.float32
        assert pool.num_blocks == ref_pool.num_blocks and 2 * pool.nbytes == ref_pool.nbytes
        got = _logits(engine)
        errors[name] = ((got - ref).abs().max() / scale).item()
        assert 0 < errors[name] <= CACHE_LOGITS[name], errors
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert errors["float16"] < errors["bfloat16"] / 2  # the error is the entries' rounding


def test_a_bf16_pool_decodes_as_an_fp32_pool_greedy():
    """Generation end to end (prefill, then the decode path reading the bf16 pool): the same
    greedy tokens as with an fp32 pool."""
    model, _ = tiny_model("llama", seed=5, num_layers=2)
    outs = []
    for dtype in (None, "bfloat16"):
        engine = make_engine(model, {}, "fullshared", kv_cache_dtype=dtype)
        s = engine.session()
        s.append(list(range(3, 40)))
        outs.append(s.generate(agent=None, max_new_tokens=12, temperature=0.0).token_ids)
    assert outs[0] == outs[1]


def test_a_replica_spec_honours_the_cache_dtype_and_swap_space(tiny, monkeypatch):
    """``serve --replicas`` builds each replica's engine from an ``EngineSpec``: the options it
    carries reach the engine (the load itself replaced by the tiny model)."""
    import precache
    from precache.cluster.config import EngineSpec

    model, dirs, _ = tiny
    seen = {}

    def fake_load(path, **options):
        seen.update(options)
        model.kv_cache_dtype = options["kv_cache_dtype"]  # what load_model does with it
        return model

    monkeypatch.setattr(precache, "load_model", fake_load)
    spec = EngineSpec(
        "unused", {a: str(d) for a, d in dirs.items()}, kv_cache_dtype="bfloat16", swap_space_bytes=2**20
    )
    try:
        engine = spec()
        assert seen["kv_cache_dtype"] == "bfloat16"
        assert engine.pool.k.dtype == torch.bfloat16
        assert engine.swap_usage()["capacity"] == 2**20
    finally:
        model.kv_cache_dtype = None
