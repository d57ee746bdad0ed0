"""A captured decode layer on the CPU: eager against ``torch.compile`` (issue 22, part 2).

The part of a SmolLM2 decode layer after attention, at one row: ``x + o(attn)``, RMSNorm,
gate/up, ``silu(gate) * up``, down, residual (random weights, 30 layers, each read once per
pass), the products as precache runs them at batch 1 (the weight viewed as ``T`` output slices, one
batched product). Three sides, each in its own process so that one compile cache never helps
another, ``--rounds`` rounds interleaved; the figure is the median of 15 passes per process:

- ``eager``: plain torch;
- ``compiled``: ``torch.compile(fullgraph=True)`` (inductor's C++ backend) over the whole block;
- ``compiled, products opaque``: the same, with each product a custom op that inductor cannot
  rewrite, so it fuses only the norm, activation and residual work around them.

    python benchmarks/decode_compile_micro.py --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from precache.models.layers import split_product

HIDDEN, INTER, LAYERS = 576, 1536, 30


#: output slices per product (the torch threads; set by ``side``: dynamo cannot trace the query)
PARTS = [2]


def _split(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return split_product(x, w, None, PARTS[0])  # precache's CPU product (models.llama.linear)


@torch.library.custom_op("precache_bench::split_product", mutates_args=())
def _opaque(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _split(x, w)


@_opaque.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def _block(product):
    def block(x, attn, o, norm, gate_up, down):
        x = x + product(attn, o)
        h = F.rms_norm(x, (HIDDEN,), norm, 1e-5)
        gate, up = product(h, gate_up).split([INTER, INTER], dim=-1)
        return x + product(F.silu(gate) * up, down)

    return block


def side(name: str, threads: int) -> tuple[float, float]:
    """(first call s, median pass ms) of one side in this process."""
    torch.set_num_threads(threads)
    PARTS[0] = threads
    gen = torch.Generator().manual_seed(0)
    weights = [
        (
            torch.randn(HIDDEN, HIDDEN, generator=gen) / 24,
            torch.rand(HIDDEN, generator=gen),
            torch.randn(2 * INTER, HIDDEN, generator=gen) / 24,
            torch.randn(HIDDEN, INTER, generator=gen) / 40,
        )
        for _ in range(LAYERS)
    ]
    block = _block(_opaque if name == "compiled, products opaque" else _split)
    if name != "eager":
        block = torch.compile(block, dynamic=False, fullgraph=True)
    x, attn = torch.randn(1, HIDDEN, generator=gen), torch.randn(1, HIDDEN, generator=gen)

    def run():
        y = x
        for w in weights:
            y = block(y, attn, *w)
        return y

    with torch.inference_mode():
        t0 = time.perf_counter()
        run()
        first = time.perf_counter() - t0
        passes = []
        for _ in range(15):
            t0 = time.perf_counter()
            run()
            passes.append(time.perf_counter() - t0)
    return first, 1000 * statistics.median(passes)


SIDES = ("eager", "compiled", "compiled, products opaque")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in a child
    args = parser.parse_args()
    if args.side:
        first, median = side(args.side, args.threads)
        print(f"{first:.1f} {median:.2f}")
        return
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in SIDES}
    for _ in range(args.rounds):
        for name in SIDES:
            cmd = [sys.executable, __file__, "--side", name, "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
            results[name].append((float(out[-2]), float(out[-1])))
    print(f"post-attention block x {LAYERS} layers, 1 row, {args.threads} threads, torch {torch.__version__}")
    print("| side | first call (s) | median pass per round (ms) |")
    print("|---|---|---|")
    for name, runs in results.items():
        firsts = ", ".join(f"{f:.1f}" for f, _ in runs)
        meds = ", ".join(f"{m:.1f}" for _, m in runs)
        print(f"| {name} | {firsts} | {meds} |")


if __name__ == "__main__":
    main()
