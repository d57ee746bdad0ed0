"""Decode speed: tokens/s, ms a step and effective GB/s of N concurrent trajectories in one engine
(compiled decode step and eager, when the engine compiles) against one HF + PEFT stream, with the
machine's read bandwidth measured in the same run (gpt-fast's measure).

A decode step streams the weights once for every row of the batch, so on a memory-bound machine
N rows cost little more than one. Both sides decode ``new_tokens`` greedy tokens (``ignore_eos``)
after a ``prompt_len``-token random prompt, with the same adapter; only the decode part is timed
(from the first sampled token to the last), in one run on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

import precache
from precache.bench.common import add_common_args, hf_model_of, write_results
from precache.cli_args import model_options
from precache.compute import on_compute
from precache.methods import METHOD_REGISTRY
from precache.models.quant import QUANTIZED_WEIGHTS, resolve_kv_cache_dtype
from precache.resources import adapter_set


def engine_decode(engine, agent: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """Decode ``new_tokens`` on every prompt at once; returns ``{"tokens", "seconds", "tokens_per_s",
    "token_ids"}``: decode tokens after each trajectory's first, over the wall time from the moment
    every trajectory has its first token; ``token_ids`` each trajectory's generated ids."""
    sessions = [engine.session() for _ in prompts]
    requests = []
    for s, p in zip(sessions, prompts, strict=True):
        s.append(p)
        requests.append(s.submit(agent, max_new_tokens=new_tokens, ignore_eos=True))
    while not all(r.phase is not None and r.out for r in requests):  # every prefill done
        engine.step()
    t0 = time.perf_counter()
    engine.wait_all(requests)
    seconds = time.perf_counter() - t0
    token_ids = [r.outcome().token_ids for r in requests]
    tokens = sum(len(t) - 1 for t in token_ids)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "token_ids": token_ids}


@torch.inference_mode()
def hf_peft_decode(peft_model, prompt: list[int], new_tokens: int) -> dict:
    """One greedy stream on an HF PEFT model with a ``DynamicCache``: the same measure as
    :func:`engine_decode` for one trajectory."""
    cache = DynamicCache()
    out = peft_model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[0, -1].argmax()
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = peft_model(input_ids=token.view(1, 1), cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[0, -1].argmax()
    seconds = time.perf_counter() - t0
    return {"tokens": new_tokens - 1, "seconds": seconds, "tokens_per_s": (new_tokens - 1) / seconds}


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """The machine's memory read bandwidth in bytes/s: the median time of summing ``gib`` GiB of
    fp32 (gpt-fast's yardstick for a memory-bound decode step)."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def step_bytes(model, batch: int, context: int, fp32: bool = False) -> int:
    """Bytes one decode step reads at least: every weight matrix once (the embedding row aside) plus
    each row's KV cache (``context`` positions of K and V at every layer, in the pool's dtype:
    the model's ``kv_cache_dtype``); ``fp32``: as fp32 weights and caches (the HF + PEFT baseline's)."""

    def size(t) -> int:
        quantized = isinstance(t, QUANTIZED_WEIGHTS)
        if fp32:
            return 4 * (t.qweight.numel() if quantized else t.numel())
        return t.nbytes() if quantized else t.numel() * t.element_size()

    weights = sum(size(t) for w in model.layers for t in w.values() if t is not None)
    weights += size(model.lm_head) + size(model.norm)
    c = model.config
    cache_dtype = resolve_kv_cache_dtype(model.kv_cache_dtype, model.dtype)
    kv = 2 * c.num_layers * c.kv_size * (4 if fp32 else torch.finfo(cache_dtype).bits // 8)
    return weights + batch * context * kv


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _bench_decode(args: argparse.Namespace) -> int:
    from peft import PeftModel  # heavy; only the HF baseline needs it

    if args.threads:
        torch.set_num_threads(args.threads)
    adapters = adapter_set(args.adapters, [args.agent])
    method = METHOD_REGISTRY.canonical(args.method)
    options = model_options(args)
    model = precache.load_model(args.model, **options)
    sides = {"engine": model}
    if model.decode_graph is not None:  # the eager engine beside the compiled one, in the same run
        sides["engine_eager"] = precache.load_model(args.model, **{**options, "compile": False})
    g = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(10, 10_000, (args.prompt_len,), generator=g).tolist() for _ in range(args.concurrency)
    ]
    engines = {
        name: precache.Engine(m, adapters={args.agent: adapters[args.agent]}, method=method)
        for name, m in sides.items()
    }
    for engine in engines.values():  # warm-up: the compiled step's graphs for 1 and for more rows
        engine_decode(engine, args.agent, prompts[:2], 4)
        engine_decode(engine, args.agent, prompts[:1], 4)
    peft = PeftModel.from_pretrained(hf_model_of(model), str(adapters[args.agent])).eval()
    # every side on the compute thread: a second OpenMP team (HF on the main thread) slowed both
    # sides 2-3x when their runs interleave (precache.compute)
    on_compute(lambda: hf_peft_decode(peft, prompts[0], 4))
    runs: dict[str, list[dict]] = {name: [] for name in [*engines, "hf_peft"]}
    for _ in range(args.repeats):  # interleaved: every side sees the same drift of the machine
        for name, engine in engines.items():
            run = engine_decode(engine, args.agent, prompts, args.new_tokens)
            run.pop("token_ids")
            runs[name].append(run)
        runs["hf_peft"].append(on_compute(lambda: hf_peft_decode(peft, prompts[0], args.new_tokens)))
    bandwidth = on_compute(read_bandwidth)
    context = args.prompt_len + args.new_tokens // 2  # the mean context over the decode
    result: dict = {"read_bandwidth_GBps": bandwidth / 1e9, "repeats": args.repeats}
    for name, rs in runs.items():
        batch = 1 if name == "hf_peft" else args.concurrency
        steps = [r["seconds"] / (r["tokens"] / batch) for r in rs]  # seconds per decode step
        gbps = [step_bytes(model, batch, context, fp32=name == "hf_peft") / t / 1e9 for t in steps]
        result[name] = {
            "runs": rs,
            "tokens_per_s": _spread([r["tokens_per_s"] for r in rs]),
            "ms_per_step": _spread([1000 * t for t in steps]),
            "GBps": _spread(gbps),
        }
    result["speedup"] = (
        result["engine"]["tokens_per_s"]["median"] / result["hf_peft"]["tokens_per_s"]["median"]
    )
    # each side's precision, named: the HF + PEFT baseline always runs fp32 weights (hf_model_of)
    ours_precision = (
        f"{model.quantization} weights" if model.quantization else str(model.dtype).removeprefix("torch.")
    )
    cache_dtype = resolve_kv_cache_dtype(model.kv_cache_dtype, model.dtype)
    if cache_dtype != model.dtype:
        ours_precision += f", {str(cache_dtype).removeprefix('torch.')} KV cache"
    labels = {
        "engine": ours_precision + (", compiled decode" if model.decode_graph is not None else ", eager")
    }
    labels["engine_eager"] = ours_precision + ", eager"
    labels["hf_peft"] = "float32"
    result["precision"] = {name: labels[name] for name in runs}
    rows = [
        "| side | trajectories | tokens/s (min / median / max) | ms a step (median) | GB/s (median) | of read bandwidth |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in runs:
        r, batch = result[name], 1 if name == "hf_peft" else args.concurrency
        side = "hf-peft" if name == "hf_peft" else f"precache {method}"
        tps, gb = r["tokens_per_s"], r["GBps"]["median"]
        rows.append(
            f"| {side} ({labels[name]}) | {batch} | {tps['min']:.1f} / {tps['median']:.1f} / {tps['max']:.1f} | "
            f"{r['ms_per_step']['median']:.1f} | {gb:.1f} | {gb * 1e9 / bandwidth:.2f} |"
        )
    text = "\n".join(rows) + (
        f"\n\nMachine read bandwidth (1 GiB fp32 sum, median of 5): {bandwidth / 1e9:.1f} GB/s. "
        f"Speed-up over one HF + PEFT stream (medians): {result['speedup']:.2f}x\n"
    )
    return write_results(result, text, args)


def add_bench_decode(bench_sub) -> None:
    """Register ``precache bench decode``."""
    p = bench_sub.add_parser("decode", help="batched decode tokens/s against one HF + PEFT stream")
    p.add_argument("--concurrency", type=int, default=16, help="trajectories decoding together")
    p.add_argument("--prompt-len", type=int, default=256, help="random prompt tokens per trajectory")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per trajectory")
    p.add_argument("--agent", default="plan", help="the adapter both sides decode with")
    p.add_argument(
        "--method",
        default="prelrshared",
        help="the engine's sharing method: " + ", ".join(METHOD_REGISTRY.names),
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--repeats", type=int, default=3, help="interleaved runs of every side (min / median / max)"
    )
    add_common_args(p, None)
    p.set_defaults(func=_bench_decode)
