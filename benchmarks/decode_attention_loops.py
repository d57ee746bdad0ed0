"""How fast inductor's loops read the pool at a long context: the compiled decode step's attention
terms alone, against plain reads of the same bytes, all compiled in one process and timed in
interleaved rounds (min / median / max ms a layer).

Each side is a chain of 30 layers (each layer's input depends on the last, as in the step) over
one window run of ``--keys`` pool rows of SmolLM2-135M's shape (3 KV heads of 64, 3 queries a
head), fp32, compiled as the step is (at a short context first, the key count dynamic):

- ``values``: ``precache.models.step_attention._weighted_values`` as the step runs it;
- ``values_4keys``: the same sum with each chunk's keys taken four at a time as pointwise terms
  (four independent products a loop iteration instead of one chained add);
- ``values_mkl``: ``P^T V`` for all heads as one ``[9, L] x [L, 192]`` product (MKL), the
  diagonal blocks kept;
- ``read_chunked``: the values summed over the keys in the same chunked loop, no weights;
- ``read_flat``: the same bytes summed flat (the machine's read speed for a layer's values);
- ``scores``: ``_scores`` as the step runs it; ``scores_mkl``: ``K [L, 192] x Q [192, 9]`` with a
  block-diagonal query (MKL's tall-skinny product over the contiguous key rows);
- ``gathered``: ``_gathered_values`` as the step runs it for one row whose keys are scattered over
  the pool (every other block of 16 rows, as two stores written in turn lie: ReBaseOwnShared's),
  each value read through its slot in the chunked sum; ``gathered_mm``: the batch's form, a
  gathered copy of the values and a product per head.

Every other form of a term is checked against the step's own on the same inputs before it is timed.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/decode_attention_loops.py --keys 4000 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from precache.models import step_attention as sa

LAYERS, HKV, G, D = 30, 3, 3, 64
CHUNK = sa.VALUE_CHUNK


def _chunked(weights, W, values):
    chunks = sa._chunk_count(W)
    n = chunks * CHUNK
    inside = torch.arange(n) < W
    v = torch.where(inside[:, None, None], values[:n].float(), 0.0)
    return chunks, v.view(chunks, CHUNK, HKV, D), sa._in_chunks(weights[:W], 0, W)


def values(weights, W, v):
    return sa._weighted_values(weights, 0, W, v)


def values_4keys(weights, W, values):
    chunks, v, p = _chunked(weights, W, values)
    v = v.view(chunks, CHUNK // 4, 4, HKV, 1, D)
    p = p.reshape(chunks, CHUNK // 4, 4, HKV, G)[..., None]
    terms = [p[:, :, i] * v[:, :, i] for i in range(4)]
    return ((terms[0] + terms[1]) + (terms[2] + terms[3])).sum(1).sum(0)


def values_mkl(weights, W, values):
    chunks, v, p = _chunked(weights, W, values)
    n = chunks * CHUNK
    full = torch.mm(p.reshape(n, HKV * G).t(), v.reshape(n, HKV * D)).view(HKV, G, HKV, D)
    return torch.stack([full[h, :, h] for h in range(HKV)])


def read_chunked(weights, W, values):
    chunks = sa._chunk_count(W)
    v = values[: chunks * CHUNK].view(chunks, CHUNK, HKV, 1, D)
    return v.sum(1).sum(0).expand(HKV, G, D) * weights[0, :, :, None]


def read_flat(weights, W, values):
    return values[: sa._chunk_count(W) * CHUNK].sum() * weights[0, :, :, None].expand(HKV, G, D)


def scores(q, k):
    return sa._scores(q[None, None], k[None])[0]


def scores_mkl(q, k):
    eye = torch.eye(HKV)
    block = (q.permute(0, 2, 1)[:, :, None, :] * eye[:, None, :, None]).reshape(HKV * D, HKV * G)
    return torch.mm(k.reshape(k.shape[0], HKV * D), block).view(-1, HKV, G)


def gathered(weights, slots, layer_values):
    own = torch.zeros(1, HKV, D)
    is_self = torch.zeros(1, slots.shape[0], dtype=torch.bool)
    return sa._gathered_values(weights[None], slots[None], is_self, own, layer_values)[0]


def gathered_mm(weights, slots, layer_values):
    return torch.matmul(weights.permute(1, 2, 0), layer_values[slots].permute(1, 0, 2))


def interleaved_slots(n: int) -> torch.Tensor:
    """``n`` pool rows in every other block of 16 (the keys of one of two stores written in turn)."""
    return (torch.arange(n) // 16) * 32 + torch.arange(n) % 16


def _gathered_chain(term):
    def run(weights, pool, slots):
        x = torch.zeros(HKV, G, D)
        for layer in range(LAYERS):
            x = term(weights * (1 + x[0, 0, 0]), slots, pool[layer]) + x
        return x

    return run


def _value_chain(term):
    def run(weights, pool, rows):
        W, x = rows.shape[0], torch.zeros(HKV, G, D)
        for layer in range(LAYERS):
            x = term(weights * (1 + x[0, 0, 0]), W, pool[layer, : W + sa.VALUE_PAD]) + x
        return x

    return run


def _score_chain(term):
    def run(q, pool, rows):
        W, x = rows.shape[0], torch.zeros(())
        for layer in range(LAYERS):
            x = x + term(q * (1 + x), pool[layer, :W]).amax() * 1e-6
        return x

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed calls a round (median kept)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # every side's chain is one code object, compiled twice
    torch.manual_seed(0)
    pool = torch.randn(LAYERS, 2 * args.keys + 2 * sa.VALUE_PAD, HKV, D)  # room for the scattered rows
    sides = {
        name: (_value_chain(f), "values")
        for name, f in [
            ("values", values),
            ("values_4keys", values_4keys),
            ("values_mkl", values_mkl),
            ("read_chunked", read_chunked),
            ("read_flat", read_flat),
        ]
    }
    sides |= {"scores": (_score_chain(scores), "scores"), "scores_mkl": (_score_chain(scores_mkl), "scores")}
    sides |= {
        name: (_gathered_chain(f), "gathered")
        for name, f in [("gathered", gathered), ("gathered_mm", gathered_mm)]
    }
    # one input of each kind for every side at each context, so the other forms can be checked
    # against the step's own term (a side that computes something else would time something else)
    firsts = {
        n: {"values": torch.rand(n, HKV, G) * 1e-3, "scores": torch.randn(HKV, G, D)}
        for n in (300, args.keys)
    }
    for first in firsts.values():
        first["gathered"] = first["values"].clone()  # marked dynamic apart from the values sides
    compiled, inputs, reference = {}, {}, {}
    for name, (fn, kind) in sides.items():
        compiled[name] = torch.compile(fn)
        for n in (300, args.keys):  # as the step: a short context first, then the long one
            rows = interleaved_slots(n) if kind == "gathered" else torch.empty(n)
            torch._dynamo.mark_dynamic(rows, 0)
            if kind == "gathered":
                torch._dynamo.mark_dynamic(firsts[n][kind], 0)
            compiled[name](firsts[n][kind], pool, rows)
        inputs[name] = (firsts[args.keys][kind], pool, rows)
        got = compiled[name](*inputs[name])
        if name in ("values", "scores", "gathered"):  # the step's own form of each kind
            reference[kind] = fn(*inputs[name])
        if not name.startswith("read"):  # the reads sum the values unweighted: other maths
            torch.testing.assert_close(got, reference[kind], rtol=1e-4, atol=1e-4)
    times = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in sides if r % 2 == 0 else reversed(sides):
            ts = []
            for _ in range(args.steps):
                start = time.perf_counter()
                compiled[name](*inputs[name])
                ts.append(time.perf_counter() - start)
            times[name].append(statistics.median(ts) / LAYERS * 1e3)
    value_bytes = args.keys * HKV * D * 4
    print(
        f"{args.keys} keys, {args.threads} threads, {args.rounds} rounds: ms a layer (min / median / max), GB/s at the median"
    )
    for name, ms in times.items():
        lo, mid, hi = min(ms), statistics.median(ms), max(ms)
        print(f"{name:>13}: {lo:.3f} / {mid:.3f} / {hi:.3f}   {value_bytes / mid / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
