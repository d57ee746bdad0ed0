"""The gathered layout's two attention products at a batch, compiled alone (inductor, C++ wrapper,
dynamic shapes) or eager: ``B`` rows of ``L`` keys gathered from a pool of SmolLM2's shape (3 KV heads
of 3 queries, head_dim 64), the row's own key taken from the step, 30 layers of distinct tensors.
Scores as a sum over head_dim (``s_sum``, the step's) or per head (``s_bmm``); values as the flat
product of every head against every head (``v_flat``), per head (``v_bmm``, the step's gathered
layout) or a sum over the keys (``v_sum``). Median and min milliseconds a layer over 7 rounds.

    python benchmarks/decode_attention_batch_micro.py 16 300 compiled
"""

import statistics
import sys
import time

import torch
import torch._inductor.config as ic

torch.set_num_threads(2)
B, L, HKV, G, D, LAYERS = int(sys.argv[1]), int(sys.argv[2]), 3, 3, 64, 30
ROWS = B * L + 500
g = torch.Generator().manual_seed(0)
pool_k = torch.randn(LAYERS + 1, ROWS, HKV, D, generator=g)
pool_v = torch.randn(LAYERS + 1, ROWS, HKV, D, generator=g)
# each row's keys one contiguous run of pool rows, as a trajectory's lie after its prefill
slots = torch.stack([torch.arange(b * L, (b + 1) * L) for b in range(B)]) + 100
is_self = torch.zeros(B, L, dtype=torch.bool)
is_self[:, -1] = True
q = torch.randn(B, HKV, G, D, generator=g)
own_k = torch.randn(B, HKV, D)
own_v = torch.randn(B, HKV, D)


def gather(pool, layer, own):
    return torch.where(is_self[:, :, None, None], own.unsqueeze(1), pool[layer][slots])


def s_sum(q, pk, layer, own):
    keys = gather(pk, layer, own)
    return (keys[:, :, :, None, :] * q[:, None]).sum(-1).permute(0, 2, 3, 1)  # B Hkv G L


def s_bmm(q, pk, layer, own):
    keys = gather(pk, layer, own)
    return torch.matmul(q, keys.permute(0, 2, 3, 1))


def v_flat(p, pv, layer, own):
    values = gather(pv, layer, own)
    out = torch.bmm(p.reshape(B, HKV * G, -1), values.view(B, -1, HKV * D))
    return torch.diagonal(out.view(B, HKV, G, HKV, D), dim1=1, dim2=3).permute(0, 3, 1, 2)


def v_bmm(p, pv, layer, own):
    values = gather(pv, layer, own)
    return torch.matmul(p, values.permute(0, 2, 1, 3))


def v_sum(p, pv, layer, own):
    values = gather(pv, layer, own)
    return (p[..., None] * values.permute(0, 2, 1, 3)[:, :, None]).sum(3)


p = torch.softmax(torch.randn(B, HKV, G, L, generator=g), -1)
sides = {
    "s_sum": (s_sum, q, pool_k, own_k),
    "s_bmm": (s_bmm, q, pool_k, own_k),
    "v_flat": (v_flat, p, pool_v, own_v),
    "v_bmm": (v_bmm, p, pool_v, own_v),
    "v_sum": (v_sum, p, pool_v, own_v),
}
ref = s_bmm(q, pool_k, 1, own_k)
assert torch.allclose(s_sum(q, pool_k, 1, own_k), ref, atol=1e-3)
refv = v_bmm(p, pool_v, 1, own_v)
assert torch.allclose(v_flat(p, pool_v, 1, own_v), refv, atol=1e-4)
mode = sys.argv[3] if len(sys.argv) > 3 else "compiled"
times = {k: [] for k in sides}
with ic.patch({"cpp_wrapper": True}):
    fns = {k: (torch.compile(f, dynamic=True) if mode == "compiled" else f) for k, (f, *_) in sides.items()}
    for _ in range(7):
        for k, (_f, a, pool, own) in sides.items():
            t0 = time.perf_counter()
            for layer in range(1, LAYERS + 1):
                fns[k](a, pool, layer, own)
            times[k].append(1000 * (time.perf_counter() - t0) / LAYERS)
for k, t in times.items():
    print(f"B={B} L={L} {mode} {k}: min {min(t):.3f} med {statistics.median(t):.3f} ms/layer")
