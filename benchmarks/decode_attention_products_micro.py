"""The two products of a decode step's attention, compiled alone, in each way the step could write
them: one query row of SmolLM2's shape (3 KV heads of 3 queries, head_dim 64) over ``L`` keys that
lie in a run of pool rows ``[L, n_kv_heads, head_dim]``, 30 layers of distinct tensors, the key
count a dynamic dimension as in the step (``--static`` fixes it).

- scores ``q K^T``: ``bmm`` (per head, ``[G, D] x [D, L]``: the step before issue 34's third
  session), ``flat`` (one product of the keys as they lie, ``[L, Hkv*D]``, with the queries as a
  block-diagonal matrix), ``sum`` (a product and a sum over ``D``: what the step uses);
- values ``P V``: ``bmm`` (per head), ``flat`` (one product of every head's weights with the values
  as they lie, the matching blocks kept: what the step uses), ``sum`` (a sum over the keys: as
  fast, but inductor's float sum over more than 4,096 elements is another kernel behind a guard,
  which would recompile the step once a context passed 4,096 keys).

Prints min and median milliseconds per layer over 9 rounds of 30 layers, the sides interleaved.

    python benchmarks/decode_attention_products_micro.py --context 4096 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._inductor.config as inductor_config

HKV, G, D, LAYERS = 3, 3, 64, 30


def scores_bmm(q, k):
    return torch.matmul(q, k.permute(1, 2, 0))  # [Hkv, G, L]


def scores_flat(q, k):
    eye = torch.eye(HKV)
    blocks = (q[:, :, None, :] * eye[:, None, :, None]).reshape(HKV * G, HKV * D)
    return torch.mm(k.flatten(1), blocks.t())  # [L, Hkv * G]


def scores_sum(q, k):
    return (k[:, :, None, :] * q[None]).sum(-1)  # [L, Hkv, G]


def values_bmm(p, v):
    return torch.matmul(p, v.permute(1, 0, 2))  # [Hkv, G, D]


def values_flat(p, v):
    out = torch.mm(p.reshape(HKV * G, -1), v.flatten(1)).view(HKV, G, HKV, D)
    return torch.diagonal(out, dim1=0, dim2=2).permute(2, 0, 1)


def values_sum(p, v):
    return (p[:, :, :, None] * v.permute(1, 0, 2)[:, None]).sum(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="keys L")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--static", action="store_true", help="the key count fixed in the graphs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    L = args.context
    g = torch.Generator().manual_seed(0)
    pool_k = torch.randn(LAYERS, L + 100, HKV, D, generator=g)
    pool_v = torch.randn(LAYERS, L + 100, HKV, D, generator=g)
    keys = [pool_k[i, 50 : 50 + L] for i in range(LAYERS)]  # runs of pool rows, read in place
    values = [pool_v[i, 50 : 50 + L] for i in range(LAYERS)]
    q = torch.randn(HKV, G, D, generator=g)
    p = torch.softmax(torch.randn(HKV, G, L, generator=g), -1)
    ref_s, ref_v = scores_bmm(q, keys[0]), values_bmm(p, values[0])
    assert torch.allclose(scores_flat(q, keys[0]).t().reshape(HKV, G, L), ref_s, atol=1e-4)
    assert torch.allclose(scores_sum(q, keys[0]).permute(1, 2, 0), ref_s, atol=1e-4)
    assert torch.allclose(values_flat(p, values[0]), ref_v, atol=1e-5)
    assert torch.allclose(values_sum(p, values[0]), ref_v, atol=1e-5)
    if not args.static:
        for t in (*keys, *values):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(p, 2)
    sides = {
        f"{kind} {name}": (torch.compile(fn, dynamic=False), kind)
        for kind, fns in (
            ("scores", (("bmm", scores_bmm), ("flat", scores_flat), ("sum", scores_sum))),
            ("values", (("bmm", values_bmm), ("flat", values_flat), ("sum", values_sum))),
        )
        for name, fn in fns
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    with inductor_config.patch({"cpp_wrapper": True}):
        for _ in range(9):
            for name, (fn, kind) in sides.items():
                first, tensors = (q, keys) if kind == "scores" else (p, values)
                t0 = time.perf_counter()
                for layer in range(LAYERS):
                    fn(first, tensors[layer])
                times[name].append(1000 * (time.perf_counter() - t0) / LAYERS)
    for name, t in times.items():
        print(f"L={L} {name}: min {min(t):.3f} median {statistics.median(t):.3f} ms a layer")


if __name__ == "__main__":
    main()
