"""Batched decode: tokens/s of N concurrent trajectories in one engine against one HF + PEFT stream.

A decode step streams the weights once for every row of the batch, so on a memory-bound machine
N rows cost little more than one. Both sides decode ``new_tokens`` greedy tokens (``ignore_eos``)
after a ``prompt_len``-token random prompt, with the same adapter; only the decode part is timed
(from the first sampled token to the last), in one run on the same machine.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

import precache
from precache.bench.common import add_common_args, hf_model_of, write_results
from precache.cli_args import model_options
from precache.methods import METHOD_REGISTRY
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


def _bench_decode(args: argparse.Namespace) -> int:
    from peft import PeftModel  # heavy; only the HF baseline needs it

    if args.threads:
        torch.set_num_threads(args.threads)
    adapters = adapter_set(args.adapters, [args.agent])
    method = METHOD_REGISTRY.canonical(args.method)
    model = precache.load_model(args.model, **model_options(args))
    g = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(10, 10_000, (args.prompt_len,), generator=g).tolist() for _ in range(args.concurrency)
    ]
    engine = precache.Engine(model, adapters={args.agent: adapters[args.agent]}, method=method)
    engine_decode(engine, args.agent, prompts[:2], 4)  # warm-up
    ours = engine_decode(engine, args.agent, prompts, args.new_tokens)
    peft = PeftModel.from_pretrained(hf_model_of(model), str(adapters[args.agent])).eval()
    hf_peft_decode(peft, prompts[0], 4)
    theirs = hf_peft_decode(peft, prompts[0], args.new_tokens)
    ours.pop("token_ids")
    result = {
        "engine": ours,
        "hf_peft": theirs,
        "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
    }
    # each side's precision, named: the HF + PEFT baseline always runs fp32 weights (hf_model_of)
    ours_precision = "int8 weights" if model.quantization else str(model.dtype).removeprefix("torch.")
    if model.decode_graph is not None:  # the default on a CPU; --eager: none
        ours_precision += ", compiled decode"
    result["precision"] = {"engine": ours_precision, "hf_peft": "float32"}
    text = (
        f"| side | trajectories | decode tokens | seconds | tokens/s |\n|---|---:|---:|---:|---:|\n"
        f"| precache {method} ({ours_precision}) | {args.concurrency} | {ours['tokens']} | {ours['seconds']:.2f} | "
        f"{ours['tokens_per_s']:.1f} |\n"
        f"| hf-peft (float32) | 1 | {theirs['tokens']} | {theirs['seconds']:.2f} | {theirs['tokens_per_s']:.1f} |\n\n"
        f"Speed-up: {result['speedup']:.2f}x\n"
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
    add_common_args(p, None)
    p.set_defaults(func=_bench_decode)
