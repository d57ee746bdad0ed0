"""Decode speed of N trajectories in one engine, without the baselines of ``bench decode``: the
compiled step (or ``eager``), PreLRShared with the ``qv`` adapters' ``action`` agent, N random
256-token prompts (``--prompt-len``), 32 greedy tokens each, three runs after a warm-up that
compiles the one-row and the batch graphs (cold: minutes; cached on disk after). ``prof`` adds a torch profiler table of one
more run, taken on the compute thread (set ``KPROF=1`` to see inductor's kernels one by one: it
compiles the graphs again, under its own options).

    python benchmarks/decode_batch_timing.py compiled 16
    python benchmarks/decode_batch_timing.py eager 16
    KPROF=1 python benchmarks/decode_batch_timing.py compiled 1 prof --prompt-len 4096
"""

import argparse
import os
import time

import torch

import precache
import precache.models.step_graph as step_graph
from precache.bench.decode import engine_decode
from precache.compute import on_compute
from precache.methods import METHOD_REGISTRY
from precache.resources import adapter_set

if os.environ.get("KPROF"):
    step_graph.INDUCTOR_OPTIONS = {**step_graph.INDUCTOR_OPTIONS, "cpp.enable_kernel_profile": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["compiled", "eager"])
    parser.add_argument("batch", type=int, help="trajectories decoding together")
    parser.add_argument("prof", nargs="?", choices=["prof"], help="add a profile of one more run")
    parser.add_argument("--prompt-len", type=int, default=256, help="random prompt tokens")
    args = parser.parse_args()
    torch.set_num_threads(2)
    mode, batch, prof, prompt_len = args.mode, args.batch, args.prof == "prof", args.prompt_len
    model = precache.load_model(compile=mode == "compiled")
    adapters = adapter_set("qv", ["action"])
    engine = precache.Engine(
        model, adapters={"action": adapters["action"]}, method=METHOD_REGISTRY.canonical("prelrshared")
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 10_000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    t0 = time.perf_counter()
    engine_decode(engine, "action", prompts[:2], 4)
    engine_decode(engine, "action", prompts[:1], 4)
    print(f"warm-up (compiles) {time.perf_counter() - t0:.1f} s", flush=True)
    for _ in range(3):
        r = engine_decode(engine, "action", prompts, 32)
        step_ms = 1000 * r["seconds"] / (r["tokens"] / batch)
        print(f"{mode} {batch} rows: {r['tokens_per_s']:.1f} tokens/s, {step_ms:.1f} ms a step", flush=True)
    if prof:
        from torch.profiler import profile

        def run():
            with profile() as prof:
                engine_decode(engine, "action", prompts, 8)
            return prof

        print(
            on_compute(run)
            .key_averages()
            .table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90)
        )


if __name__ == "__main__":
    main()
