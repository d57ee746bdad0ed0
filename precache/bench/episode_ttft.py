"""TTFT on real agent episodes: record NonShared's HotpotQA episodes, then replay each one with
every method, interleaved question by question, teacher-forcing the recorded turns.

Real agent turns are short (tens of tokens) and fixed per-forward costs weigh as much as attention
there; a teacher-forced replay gives every method exactly the same trajectory (same appended
observations, same generated tokens), so their TTFT sums compare like for like.
"""

from __future__ import annotations

import argparse
import gc

import torch

import precache
from precache.agents.data import load_questions
from precache.agents.loop import run_episode
from precache.bench.common import add_common_args, methods_with_reference, write_results
from precache.cli_args import add_split_argument, model_options
from precache.engine.concurrency import run_concurrently
from precache.engine.request import Turn
from precache.methods import METHODS
from precache.resources import adapter_set
from precache.terminal import progress


def replay_recorded(engine, turns: list[Turn]) -> list[Turn]:
    """Teacher-force the recorded ``turns`` (each: its ``appended`` ids, then its ``token_ids`` by its
    agent) on a new session of ``engine``; return the replayed turns (their TTFT, prefill tokens)."""
    gc.collect()
    session = engine.session()
    out = []
    for turn in turns:
        session.append(list(turn.appended))
        out.append(session.teacher_force(turn.agent, turn.token_ids))
    return out


def episode_ttft(engines: dict, recorded: list[list[Turn]]) -> dict:
    """Replay every recorded episode with every engine, rotating the method order per episode.

    Returns ``{"episodes", "turns", "methods": {method: {"sum_ttft_s", "prefill_tokens"}}}``.
    """
    totals = {m: {"sum_ttft_s": 0.0, "prefill_tokens": 0} for m in engines}
    names = list(engines)
    with progress(len(recorded), "replay" if len(recorded) > 1 else None) as advance:
        for i, turns in enumerate(recorded):
            for method in names[i % len(names) :] + names[: i % len(names)]:
                for t in replay_recorded(engines[method], turns):
                    totals[method]["sum_ttft_s"] += t.ttft_s
                    totals[method]["prefill_tokens"] += t.prefill_tokens
            advance()
    return {"episodes": len(recorded), "turns": sum(map(len, recorded)), "methods": totals}


def episode_markdown(result: dict) -> str:
    rows = result["methods"]
    full = rows.get("fullshared", {}).get("sum_ttft_s")
    ns = rows.get("nonshared", {}).get("sum_ttft_s")
    lines = [
        f"{result['episodes']} episodes, {result['turns']} turns, teacher-forced, methods interleaved.",
        "",
        "| method | sum TTFT (s) | vs FullShared | speed-up over NonShared | prefill tokens |",
        "|---|---:|---:|---:|---:|",
    ]
    for m, r in rows.items():
        vs_full = f"{r['sum_ttft_s'] / full:.3f}x" if full else "-"
        vs_ns = f"{ns / r['sum_ttft_s']:.2f}x" if ns else "-"
        lines.append(f"| {m} | {r['sum_ttft_s']:.2f} | {vs_full} | {vs_ns} | {r['prefill_tokens']:,} |")
    return "\n".join(lines) + "\n"


def _bench_episodes(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    questions = load_questions(args.split)[: args.limit]
    adapters = adapter_set(args.adapters, ["plan", "action", "reflect"])
    methods = methods_with_reference(args.methods)
    model = precache.load_model(args.model, **model_options(args))
    # every method replays the same recorded stream: no trajectory may reuse another's blocks
    engines = {m: precache.Engine(model, adapters=adapters, method=m, prefix_caching=False) for m in methods}
    record = engines["nonshared"]
    episodes = run_concurrently(
        lambda q: run_episode(
            record.session(), q, max_steps=args.max_steps, max_new_tokens=args.max_new_tokens
        ),
        questions,
        args.concurrency,
        desc="record",
    )
    result = episode_ttft(engines, [e.turns for e in episodes])
    return write_results(result, episode_markdown(result), args)


def add_bench_episodes(bench_sub) -> None:
    """Register ``precache bench episodes``."""
    p = bench_sub.add_parser("episodes", help="TTFT of every method on recorded HotpotQA episodes")
    add_split_argument(p)
    p.add_argument("--limit", type=int, default=20, help="first N questions of the split")
    p.add_argument("--max-steps", type=int, default=8, help="plan steps per episode")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per agent turn")
    p.add_argument("--concurrency", type=int, default=4, help="episodes recorded at once")
    add_common_args(p, ",".join(METHODS))
    p.set_defaults(func=_bench_episodes)
