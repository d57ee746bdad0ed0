"""Capacity: in one fixed KV-cache budget, how many concurrent multi-agent trajectories stay resident.

Each method gets one engine whose block pool is exactly ``kv_cache_bytes``; trajectories of a
trace (the paper shape, every agent reading the whole shared trajectory) are replayed one after
another and all kept alive, as a server holds the conversations it serves, until the next one no
longer fits beside them: the engine then swaps the least recently used idle one out of the pool to
host memory (or, with nothing left to swap, raises :class:`~precache.errors.OutOfBlocksError`), and
the trajectories still in the pool are the resident ones. Turns are generated greedily with
``ignore_eos`` and exactly the trace's decode lengths, over the trace's seeded random token stream.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

import torch

import precache
from precache.bench.common import add_common_args, methods_with_reference, special_ids, write_results
from precache.bench.trace import Trace, load_trace, paper_trace, token_stream
from precache.cli_args import model_options
from precache.errors import OutOfBlocksError
from precache.methods import METHODS
from precache.resources import adapter_set, trace_path

logger = logging.getLogger(__name__)


def _replay(session, trace: Trace, stream: list[list[int]]) -> None:
    for turn, appended in zip(trace.turns, stream, strict=True):
        session.append(appended)
        session.generate(agent=turn.agent, max_new_tokens=turn.decode_len, ignore_eos=True)


def resident_trajectories(
    engine, trace: Trace, streams: Callable[[int], list[list[int]]], limit: int = 64
) -> dict:
    """Replay ``trace`` as new trajectories in ``engine`` until one no longer fits beside the
    others; keep them all. Trajectory ``i`` appends ``streams(i)`` (distinct streams: no prefix is
    shared between them).

    Returns ``{"resident": n, "kv_cache_bytes", "block_bytes", "allocated_bytes",
    "bytes_per_trajectory", "seconds"}``: ``resident`` trajectories whose caches are whole in the
    pool once the pool is full (the ones swapped out to make room, or one that failed, do not
    count; their blocks are free), ``bytes_per_trajectory`` the allocated bytes of one.
    """
    sessions, t0 = [], time.perf_counter()
    while len(sessions) < limit:
        session = engine.session()
        try:
            _replay(session, trace, streams(len(sessions)))
        except OutOfBlocksError:
            session.close()  # the one that did not fit: its blocks go back before counting
            break
        sessions.append(session)
        if any(s.swapped is not None for s in sessions):  # the pool is full: one had to leave it
            break
        logger.info("%s: %d trajectories resident", engine.method_name, len(sessions))
    for s in [s for s in sessions if s.swapped is not None]:
        sessions.remove(s)
        s.close()
    usage = engine.cache_usage()
    n = len(sessions)
    return {
        "resident": n,
        "kv_cache_bytes": usage["total"],
        "block_bytes": engine.pool.block_bytes,
        "allocated_bytes": usage["allocated"],
        "bytes_per_trajectory": usage["allocated"] // n if n else None,
        "seconds": time.perf_counter() - t0,
    }


def capacity_markdown(result: dict) -> str:
    """A markdown table of :func:`resident_trajectories` per method, with the ratio to NonShared."""
    rows = result["methods"]
    ref = rows.get("nonshared", {}).get("resident") or None
    lines = [
        f"Trace `{result['trace']}`, KV-cache budget {result['kv_cache_bytes'] / 2**20:.0f} MiB.",
        "",
        "| method | resident trajectories | vs NonShared | MiB per trajectory |",
        "|---|---:|---:|---:|",
    ]
    for method, r in rows.items():
        per = f"{r['bytes_per_trajectory'] / 2**20:.1f}" if r["bytes_per_trajectory"] else "-"
        ratio = f"{r['resident'] / ref:.2f}x" if ref else "-"
        lines.append(f"| {method} | {r['resident']} | {ratio} | {per} |")
    return "\n".join(lines) + "\n"


def _bench_capacity(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    trace = paper_trace(args.paper_len) if args.trace is None else load_trace(trace_path(args.trace))
    adapters = adapter_set(args.adapters, trace.agents)
    methods = methods_with_reference(args.methods)
    model = precache.load_model(args.model, **model_options(args))
    special = special_ids(model)

    def streams(i: int) -> list[list[int]]:
        return token_stream(trace, model.config.vocab_size, special, args.seed + i)

    result = {"trace": trace.name, "kv_cache_bytes": args.kv_cache_bytes, "methods": {}}
    for method in methods:
        engine = precache.Engine(model, adapters=adapters, method=method, kv_cache_bytes=args.kv_cache_bytes)
        result["methods"][method] = resident_trajectories(engine, trace, streams, args.limit)
        del engine
    return write_results(result, capacity_markdown(result), args)


def add_bench_capacity(bench_sub) -> None:
    """Register ``precache bench capacity``."""
    p = bench_sub.add_parser("capacity", help="how many trajectories stay resident in one KV-cache budget")
    p.add_argument("--kv-cache-bytes", type=int, required=True, help="the block pool's budget in bytes")
    p.add_argument("--paper-len", type=int, default=256, help="L of the paper trace (when no --trace)")
    p.add_argument("--trace", default=None, help="CSV or shipped trace name instead of the paper shape")
    p.add_argument("--limit", type=int, default=64, help="stop after this many resident trajectories")
    p.add_argument("--seed", type=int, default=0, help="seed of the appended random token stream")
    add_common_args(p, ",".join(METHODS))
    p.set_defaults(func=_bench_capacity)
