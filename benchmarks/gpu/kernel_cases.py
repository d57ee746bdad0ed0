"""The triton kernel's cases one process each, so that a fault in one (an illegal memory access
poisons the whole CUDA context) leaves the others' figures: kernel time, SDPA time and the largest
error against the torch backend, as part 1 of ``benchmarks/gpu/run.sh`` measures them
(:func:`precache.bench.gpu_kernel._case`), on one Llama-3.1-8B-shaped attention layer in bf16.

    PYTHONPATH=. python benchmarks/gpu/kernel_cases.py [CASE ...] [--stages N] [--splits N] [--blocking] [--unrefused]

``--blocking`` sets CUDA_LAUNCH_BLOCKING=1 (a fault is reported at the launch that made it; the
times are then not comparable with run.sh's). ``--stages`` / ``--splits`` override the pipeline
stages and the flash-decoding splits; ``--unrefused`` runs the k-side LR tiles that the backend
refuses on CUDA (``K_LR_MAX_CUDA_SLOTS``), to test a fix. Prints one line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

#: name: (LR kind, queries, keys, batch)
CASES = {
    "base-prefill-16x64": ("base", 16, 64, 1),
    "base-prefill-1024x5120": ("base", 1024, 5120, 1),
    "base-decode-8x8192": ("base", 1, 8192, 8),
    "v-prefill-128x1024": ("v", 128, 1024, 1),
    "v-decode-8x8192": ("v", 1, 8192, 8),
    "kv-prefill-16x64": ("kv", 16, 64, 1),
    "kv-prefill-128x1024": ("kv", 128, 1024, 1),
    "kv-decode-8x1024": ("kv", 1, 1024, 8),
}


def one_case(name: str, stages: int | None, splits: int | None, unrefused: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from precache.bench import gpu, gpu_kernel
    from precache.cache.attention import triton_backend, triton_metadata
    from precache.models import model_from_hf

    kind, n_q, n, batch = CASES[name]
    config = LlamaConfig(**dict(gpu.LLAMA_31_8B, vocab_size=256, intermediate_size=128, num_hidden_layers=1))
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model = model_from_hf(hf, device="cuda", max_context=48 * 1024)
    backend = triton_backend.TritonBackend
    if unrefused:
        triton_metadata.K_LR_MAX_CUDA_SLOTS = 1 << 30
    if stages is not None:
        chosen = backend._compile_options
        backend._compile_options = staticmethod(lambda q, bm: {**chosen(q, bm), "num_stages": stages})
    if splits is not None:
        init = backend.__init__
        backend.__init__ = lambda self, num_splits=None, block_n=64: init(self, splits, block_n)
    return gpu_kernel._case(model, kind, n_q, n, batch, 8, 10, 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"default: all of {', '.join(CASES)}")
    parser.add_argument("--stages", type=int)
    parser.add_argument("--splits", type=int)
    parser.add_argument("--blocking", action="store_true")
    parser.add_argument(
        "--unrefused", action="store_true", help="run the k-side LR tiles the backend refuses on CUDA"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT", json.dumps(one_case(args.child, args.stages, args.splits, args.unrefused)))
        return 0
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}")
    import torch

    if not torch.cuda.is_available():
        parser.error("the kernel's cases run on a CUDA GPU; none is visible to torch here")
    env = dict(os.environ, **({"CUDA_LAUNCH_BLOCKING": "1"} if args.blocking else {}))
    extra = [f"--{k}={v}" for k, v in (("stages", args.stages), ("splits", args.splits)) if v is not None]
    extra += ["--unrefused"] if args.unrefused else []
    for name in args.cases or CASES:
        t0 = time.perf_counter()
        child = subprocess.run(
            [sys.executable, __file__, "--child", name, *extra], env=env, capture_output=True, text=True
        )
        found = [line[7:] for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        errors = [line for line in child.stderr.splitlines() if "Error" in line][-1:]
        print(
            name, f"rc={child.returncode}", f"{time.perf_counter() - t0:.0f}s", *(found or errors), flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
