"""The weight products of one decode step on the CPU, kernel by kernel (issue 22).

30 layers of SmolLM2-shaped weights (q/k/v fused 960 x 576, o 576 x 576, gate/up fused 3072 x 576,
down 576 x 1536: 106 M parameters, random) multiplied by ``--rows`` input rows, every weight once
per pass, so each pass reads the weights from memory as a decode step does (the L3 cache holds a
few layers at most). Each kernel runs ``--passes`` passes, interleaved with the others over
``--rounds`` rounds; the figure is the median pass (min and max beside it) in ms and the weight
bytes it streamed per second. A plain ``sum`` over as many fp32 bytes is the machine's reference.

Kernels:
- ``fp32 F.linear``: MKL's product (one thread for a matrix-vector product);
- ``fp32 output split`` (precache's ``models.llama.linear`` for up to 64 rows): the weight viewed
  as ``T`` slices of output rows, one batched product;
- ``fp32 input split``: the weight stored transposed ``[d_in, d_out]``, ``T`` slices of input
  rows, one batched product and a sum of the ``T`` partial results;
- ``bf16 F.linear``: bf16 weights and inputs;
- ``int8 kernel``: ``aten._weight_int8pack_mm`` (precache's ``--quantization int8`` decode path,
  bf16 inputs and scales).

    python benchmarks/decode_products_micro.py --rows 1 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from precache.models.layers import split_product

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def _input_split(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    p = torch.get_num_threads()
    n = x.shape[0]
    d_in, d_out = wt.shape
    return torch.bmm(x.view(n, p, d_in // p).transpose(0, 1), wt.view(p, d_in // p, d_out)).sum(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(o, i, generator=gen) / i**0.5 for _ in range(LAYERS) for o, i in SHAPES]
    x = {i: torch.randn(args.rows, i, generator=gen) for _, i in SHAPES}
    xb = {i: t.bfloat16() for i, t in x.items()}
    fp32_bytes = sum(w.numel() * 4 for w in dense)
    transposed = [w.t().contiguous() for w in dense]
    bf16 = [w.bfloat16() for w in dense]
    int8 = [
        (
            torch.randint(-127, 128, w.shape, dtype=torch.int8, generator=gen),
            torch.rand(w.shape[0]).bfloat16(),
        )
        for w in dense
    ]
    flat = torch.ones(fp32_bytes // 4)
    kernels = {
        "fp32 F.linear": (lambda: [F.linear(x[w.shape[1]], w) for w in dense], fp32_bytes),
        "fp32 output split": (
            lambda: [split_product(x[w.shape[1]], w, None, args.threads) for w in dense],
            fp32_bytes,
        ),
        "fp32 input split": (lambda: [_input_split(x[w.shape[0]], w) for w in transposed], fp32_bytes),
        "bf16 F.linear": (lambda: [F.linear(xb[w.shape[1]], w) for w in bf16], fp32_bytes // 2),
        "int8 kernel": (
            lambda: [torch.ops.aten._weight_int8pack_mm(xb[q.shape[1]], q, s) for q, s in int8],
            fp32_bytes // 4,
        ),
        "sum of as many fp32 bytes": (lambda: flat.sum(), fp32_bytes),
    }
    times: dict[str, list[float]] = {name: [] for name in kernels}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (run, _) in kernels.items():
                run()  # warm-up pass
                for _ in range(args.passes):
                    t0 = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - t0)
    print(
        f"{args.rows} row(s), {args.threads} threads, {LAYERS} layers, torch {torch.__version__}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print("| kernel | weight bytes (MB) | pass ms (min / median / max) | GB/s (median) |")
    print("|---|---|---|---|")
    for name, (_, nbytes) in kernels.items():
        t = times[name]
        med = statistics.median(t)
        print(
            f"| {name} | {nbytes / 1e6:.0f} | {1000 * min(t):.1f} / {1000 * med:.1f} / {1000 * max(t):.1f} "
            f"| {nbytes / med / 1e9:.1f} |"
        )


if __name__ == "__main__":
    main()
