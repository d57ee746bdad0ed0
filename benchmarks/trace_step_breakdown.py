"""Where a decode step's time goes in a trace replay: one method, the compiled step, a trace
(default ``short_turns``), a warm-up replay (it compiles) then three timed replays; per replay
the decode rate as ``bench trace`` counts it, and wall clocks around the step's parts on the compute
thread: the step's inputs (``decode_step``), the compiled graph (``DecodeGraph._run``, dynamo's
guards included), the pool writes after it (``DecodeStep.write``) and the sampler
(``Decoder.step``); what is left of a step is the scheduler and the session.

    python benchmarks/trace_step_breakdown.py nonshared
    python benchmarks/trace_step_breakdown.py prelrshared --trace paper_L1024
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import precache
import precache.cache.plan as plan_module
import precache.engine.decoding as decoding
from precache.bench.replay import replay_engine
from precache.bench.trace import load_trace, token_stream
from precache.methods import METHOD_REGISTRY
from precache.models.contract import DecodeStep
from precache.models.step_graph import DecodeGraph
from precache.resources import adapter_set, trace_path

SECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()


def _clocked(owner, name: str, part: str) -> None:
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[part] += time.perf_counter() - t0
            CALLS[part] += 1

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method")
    parser.add_argument("--trace", default="short_turns")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _clocked(plan_module, "decode_step", "inputs")
    _clocked(DecodeGraph, "_run", "graph")
    _clocked(DecodeStep, "write", "writes")
    _clocked(decoding.Decoder, "step", "sampler")
    trace = load_trace(trace_path(args.trace))
    model = precache.load_model(require_tokenizer=False)
    method = METHOD_REGISTRY.canonical(args.method)
    engine = precache.Engine(
        model, adapters=adapter_set("qv", trace.agents), method=method, prefix_caching=False
    )
    stream = token_stream(trace, model.config.vocab_size, [], 0)
    t0 = time.perf_counter()
    replay_engine(engine, trace, stream)
    print(f"warm-up replay {time.perf_counter() - t0:.1f} s", flush=True)
    for _ in range(3):
        SECONDS.clear(), CALLS.clear()
        replay = replay_engine(engine, trace, stream)
        steps = sum(t.new_tokens - 1 for t in replay.turns)
        decode_s = sum(t.decode_s for t in replay.turns)
        parts = ", ".join(f"{k} {1000 * SECONDS[k] / max(1, CALLS[k]):.2f} ms x{CALLS[k]}" for k in SECONDS)
        print(
            f"{method} {args.trace}: decode {steps / decode_s:.1f} tokens/s, "
            f"{1000 * decode_s / steps:.2f} ms a step over {steps} steps; {parts}",
            flush=True,
        )


if __name__ == "__main__":
    main()
