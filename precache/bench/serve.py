"""``precache bench serve``: the serving benchmark. For each method and request rate, start the
server on loopback (in this process), replay N trajectories of a trace with the ``openai`` client
(:mod:`precache.bench.loadgen`) and report p50/p90 TTFT, latency and throughput; optionally
plot TTFT against the request rate. With ``--replicas N`` the server is a Ray Serve cluster and
each ``--router`` runs the same load (:mod:`precache.bench.serve_cluster`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from pathlib import Path

from rich.table import Table

import precache
from precache.bench.serve_cluster import run_cluster_bench
from precache.bench.trace import Trace, TraceTurn, check_fits, load_trace
from precache.cli_args import positive_int
from precache.cluster import ClusterArgumentError
from precache.errors import TraceError
from precache.methods import METHOD_REGISTRY
from precache.resources import adapter_set, trace_path
from precache.server.args import (
    adapters_from_args,
    add_engine_arguments,
    load_model_from_args,
    served_model_name,
)
from precache.server.config import ServerConfig
from precache.terminal import console

logger = logging.getLogger(__name__)

#: a small smoke trace: a planner read, then short action / reflect / plan turns
SMOKE_TRACE = Trace(
    "serve-smoke",
    (
        TraceTurn("plan", 96, 16),
        TraceTurn("action", 24, 8),
        TraceTurn("reflect", 16, 8),
        TraceTurn("plan", 32, 8),
    ),
)


def run_serve_bench(
    model,
    adapters: dict,
    methods: list[str],
    qps_levels: list[float],
    sessions: int,
    trace: Trace = SMOKE_TRACE,
    model_name: str = "base",
    seed: int = 0,
) -> dict:
    """Benchmark every method at every request rate (requests/s) on a fresh server each, the
    method's decode graphs compiled before its first server starts (:meth:`Engine.compile_decode_step`).

    Returns ``{"trace", "sessions", "qps", "methods": {method: {qps: summary}}}`` with the
    summaries of :func:`~precache.bench.loadgen.summarize` (times in seconds).

    Raises:
        TraceError: the trace passes the model's context length or names an unloaded adapter.
        UnknownMethodError: a method does not exist.
    """
    check_fits(trace, model.max_context)
    missing = [a for a in trace.agents if a not in adapters]
    if missing:
        raise TraceError(
            f"trace agents without an adapter: {', '.join(missing)} (loaded: {', '.join(adapters)})"
        )
    result: dict = {"trace": trace.name, "sessions": sessions, "qps": qps_levels, "methods": {}}
    for method in methods:
        engine = precache.Engine(model, adapters=adapters, method=method)
        # as `precache serve` does before it listens: without it each fresh server compiled (or
        # loaded from the disk cache, 15-25 s each) its decode graphs under the load, which set the
        # TTFT p90 (17-20 s against 1-2 s; benchmarks/RESULTS.md)
        engine.compile_decode_step()
        result["methods"][engine.method_name] = {
            str(qps): _run_level(engine, trace, sessions, qps, model_name, seed + 1000 * i)
            for i, qps in enumerate(qps_levels)
        }
    return result


def _run_level(engine, trace: Trace, sessions: int, qps: float, model_name: str, seed: int) -> dict:
    """One method at one request rate, on a fresh server: the summary of the replay."""
    # the web stack and the openai client: loaded only when a benchmark serves
    from precache.bench.loadgen import replay, summarize
    from precache.server.app import create_app
    from precache.server.live import LiveServer

    model = engine.model
    special = set(getattr(model.tokenizer, "all_special_ids", []) or []) | set(engine.eos_token_ids)
    with LiveServer(create_app(engine, ServerConfig(model_name=model_name))) as server:
        _warm_up(server.url, trace.agents[0])
        vocab = model.config.vocab_size
        records, wall = asyncio.run(replay(server.url, trace, sessions, qps, vocab, special, seed))
    s = summarize(records, wall)
    logger.info(
        "%s @ %.2f req/s: TTFT p50 %.3f s, p90 %.3f s; latency p50 %.3f s; %.1f tok/s; %d errors",
        engine.method_name,
        qps,
        s["ttft_p50_s"],
        s["ttft_p90_s"],
        s["latency_p50_s"],
        s["throughput_tok_s"],
        s["errors"],
    )
    return s


def _warm_up(base_url: str, agent: str) -> None:
    """One short request, so the first measured one does not pay for lazy initialisation."""
    import openai  # a test extra

    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        client.completions.create(model=agent, prompt=[7] * 8, max_tokens=2, temperature=0)


def plot_ttft_vs_qps(result: dict, path: str | os.PathLike) -> Path:
    """PNG: p50 (solid) and p90 (dashed) TTFT in seconds against the request rate, per method."""
    from precache.bench.plots import plt, save_figure  # matplotlib: only to draw

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, per_qps in result["methods"].items():
        qps = [float(q) for q in per_qps]
        (line,) = ax.plot(qps, [s["ttft_p50_s"] for s in per_qps.values()], marker="o", label=f"{method} p50")
        p90 = [s["ttft_p90_s"] for s in per_qps.values()]
        ax.plot(qps, p90, ls="--", color=line.get_color(), alpha=0.7, label=f"{method} p90")
    ax.set(xlabel="request rate (requests/s)", ylabel="TTFT (s)", title=f"TTFT vs load, {result['trace']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _table(result: dict) -> Table:
    table = Table(title=f"serving: {result['trace']}, {result['sessions']} trajectories")
    for header in (
        "method",
        "req/s",
        "TTFT p50",
        "TTFT p90",
        "latency p50",
        "latency p90",
        "tok/s",
        "cached",
        "prefill tok",
        "errors",
    ):
        table.add_column(header, justify="right")
    for method, per_qps in result["methods"].items():
        for qps, s in per_qps.items():
            times = [
                f"{s[k] * 1e3:.0f} ms" for k in ("ttft_p50_s", "ttft_p90_s", "latency_p50_s", "latency_p90_s")
            ]
            table.add_row(
                method,
                qps,
                *times,
                f"{s['throughput_tok_s']:.1f}",
                f"{s['cached_ratio']:.0%}",
                str(s["prefill_tokens"]),
                str(s["errors"]),
            )
    return table


def _bench_serve(args: argparse.Namespace) -> int:
    for name in ("httpx", "httpx2"):  # the openai client logs every request at INFO
        logging.getLogger(name).setLevel(logging.WARNING)

    trace = load_trace(trace_path(args.trace)) if args.trace else SMOKE_TRACE
    adapters = adapters_from_args(args) or adapter_set(args.adapters, trace.agents)
    methods = [METHOD_REGISTRY.canonical(m.strip()) for m in args.methods.split(",") if m.strip()]
    routers = _routers(args)
    model = load_model_from_args(args)
    name = served_model_name(args, model)
    if routers:
        result = run_cluster_bench(
            model,
            adapters,
            methods,
            routers,
            args.replicas,
            args.qps,
            args.sessions,
            trace,
            name,
            args.seed,
            1.0 if args.num_cpus_per_replica is None else args.num_cpus_per_replica,
        )
    else:
        result = run_serve_bench(model, adapters, methods, args.qps, args.sessions, trace, name, args.seed)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    console().print(_table(result))
    if args.plot:
        logger.info("wrote %s", plot_ttft_vs_qps(result, args.plot))
    return 0


def _routers(args: argparse.Namespace) -> list[str]:
    """The routers to compare on a cluster (``--replicas``), or ``[]`` for the single server.

    Raises:
        ClusterArgumentError: ``--router`` or ``--num-cpus-per-replica`` without ``--replicas``, or
        an unknown router name.
    """
    if args.replicas is None:
        for flag in ("router", "num_cpus_per_replica"):
            if getattr(args, flag) is not None:
                raise ClusterArgumentError(f"--{flag.replace('_', '-')} needs --replicas N")
        return []
    routers = [r.strip() for r in (args.router or "affinity,default").split(",") if r.strip()]
    unknown = [r for r in routers if r not in ("affinity", "default")]
    if unknown or not routers:
        raise ClusterArgumentError(f"--router takes affinity and/or default, got {args.router!r}")
    return routers


def _rates(text: str) -> list[float]:
    """``"0.5,1,2"`` -> ``[0.5, 1.0, 2.0]`` requests/s (an argparse ``type``).

    Raises:
        argparse.ArgumentTypeError: a rate is not a number > 0.
    """
    try:
        rates = [float(q) for q in text.split(",") if q.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated numbers, got {text!r}") from None
    if not rates or any(q <= 0 for q in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0, got {text!r}")
    return rates


def add_bench_serve(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``serve`` on the ``precache bench`` sub-parsers."""
    p = bench_sub.add_parser("serve", help="serving benchmark: TTFT, latency, throughput vs request rate")
    add_engine_arguments(p)
    p.add_argument(
        "--methods",
        default="prelrshared,nonshared",
        help="comma-separated sharing methods: " + ", ".join(METHOD_REGISTRY.names),
    )
    p.add_argument(
        "--adapters",
        default="qv",
        help="without --lora-modules: qv | all (committed sets) | DIR with DIR/<agent>/",
    )
    p.add_argument(
        "--qps", type=_rates, default="0.5,1,2,4", help="comma-separated request rates (requests/s)"
    )
    p.add_argument("--sessions", type=positive_int, default=4, help="concurrent trajectories")
    p.add_argument(
        "--trace",
        default=None,
        help="CSV agent,prefill_len,decode_len or a shipped name (default: a smoke trace)",
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, help="results file")
    p.add_argument("--plot", default=None, help="PNG: TTFT vs request rate")
    p.add_argument(
        "--replicas", type=positive_int, default=None, help="benchmark a Ray Serve cluster of N replicas"
    )
    p.add_argument(
        "--router", default=None, help="with --replicas: affinity | default | affinity,default (the default)"
    )
    p.add_argument("--num-cpus-per-replica", type=float, default=None, help="with --replicas (default 1)")
    p.set_defaults(func=_bench_serve)
