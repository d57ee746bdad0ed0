"""``precache bench soak``: a server under mixed, faulty load for a bounded time.

For ``--duration`` seconds, on loopback, against ``precache serve``'s app in this process
(:class:`~precache.server.live.LiveServer`) with a small block pool and tight client limits, or,
with ``--replicas N``, against ``precache serve --replicas N`` on a local Ray instance (one
replica killed half-way, as a crash would):

- ``--tenants`` tenants (each its own ``cache_salt``) send completions in a loop, each a fresh
  random prompt for a random agent, greedy, streamed or not; a fifth of their streams hang up
  after two chunks (client disconnects);
- a stalled reader opens a long stream (4 choices with 20 log-probabilities a token: far more than the
  connection's buffers)
  over a socket with a tiny receive buffer and never reads it, again and again (the server must
  hold it, then cancel it);
- a slowloris client keeps a few sockets open that send a request's headers a byte at a time
  (one server must time them out; a cluster's connections end at Ray Serve's proxy, whose
  behaviour is reported as measured).

Afterwards it reports requests served, errors by status and code, the refusals the servers
counted, each server process's RSS over time (``process_resident_memory_bytes`` of ``/metrics``),
the tokens of every completed request that differ from the same request run alone on a fresh
engine (must be 0: no tenant's tokens depend on the load, nor on a replica dying), and the blocks
still held once every idle conversation is dropped, on every live replica (must be 0: nothing
leaked). ``--idle-conversations N`` adds a phase of N idle conversations against a bounded host
swap space (:mod:`precache.bench.soak_idle`): the RSS it adds stays within ``--swap-space``.

The clients are :mod:`precache.bench.soak_load`'s, the servers :mod:`precache.bench.soak_target`'s;
this module drives them, checks the tokens and reports.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from pathlib import Path

import precache
from precache.bench.common import ordinary_ids
from precache.bench.soak_load import MAX_TOKENS, SoakLoad
from precache.bench.soak_target import Target, cluster, one_server, server_metrics
from precache.cli_args import positive_float, positive_int
from precache.terminal import console

logger = logging.getLogger(__name__)


def run_soak(model, adapters: dict, method: str, duration_s: float, tenants: int, kv_cache_bytes: int | None, seed: int,
             verify_limit: int, stall_hold_s: float = 20.0, replicas: int | None = None, model_arg=None,
             compile: bool | None = None) -> dict:  # fmt: skip
    """Run the soak described in the module docstring; returns the report (JSON-ready).
    ``model`` is the loaded model (the verification engine's, and one server's); with
    ``replicas``, each replica loads ``model_arg`` (a checkpoint path; None: the embedded model)
    itself, with ``compile`` (None: the compiled decode step on a CPU). ``stall_hold_s``: how long
    each stalled reader keeps its socket open without reading (well past the servers' 2 s stall
    timeout once its buffers are full)."""
    from precache.server import ServerConfig

    config = ServerConfig(
        model_name="base", stream_buffer_events=16, stream_stall_timeout_s=2.0, max_requests_in_flight=64
    )
    if replicas:
        target = cluster(model_arg, adapters, method, kv_cache_bytes, config, replicas, compile)
    else:
        target = one_server(model, adapters, method, kv_cache_bytes, config)
    with target as server:
        load = SoakLoad(
            server.url, list(adapters), ordinary_ids(model), tenants, seed, time.monotonic() + duration_s
        )
        run = _drive(server, load, duration_s, stall_hold_s)
    checked = load.completed[:verify_limit]
    return {
        "method": method,
        "duration_s": duration_s,
        "tenants": tenants,
        "replicas": replicas,
        "replica_killed": run["replica_killed"],
        "replica_killed_at_s": run["replica_killed_at_s"],
        "kv_cache_bytes": kv_cache_bytes,
        "pool_blocks": {r["replica"]: r["blocks"] for r in run["released"]},
        "outcomes": dict(sorted(load.outcomes.items())),
        "completed": len(load.completed),
        "checked_alone": len(checked),
        "tokens_differing_from_alone": _differ_from_alone(model, adapters, method, checked),
        "stalled_readers": load.stalls,
        "slowloris_sockets_closed": load.slowloris_closed,
        "server_metrics": run["server_metrics"],
        "rss_mib": run["rss_mib"],
        "released": run["released"],
        "blocks_leaked": sum(r["blocks"] - r["blocks_free"] for r in run["released"]),
        "sessions_left": sum(r["sessions_left"] + r["jobs_left"] for r in run["released"]),
    }


def _drive(server: Target, load: SoakLoad, duration_s: float, stall_hold_s: float) -> dict:
    """Run every client of ``load`` on its own thread until its deadline, sampling each server's
    RSS every 2 s and killing a replica half-way when ``server`` can; then release the idle
    conversations. Returns ``{"replica_killed", "replica_killed_at_s", "released",
    "server_metrics", "rss_mib"}``."""
    t0 = time.monotonic()
    rss: list[tuple[float, dict[str, float]]] = []
    killed, killed_at = None, None
    threads = [threading.Thread(target=load.tenant, args=(i,)) for i in range(load.tenants)]
    threads.append(
        threading.Thread(target=load.stalled_reader, args=(server.host, server.port, stall_hold_s))
    )
    threads.append(threading.Thread(target=load.slowloris, args=(server.host, server.port, 4)))
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        elapsed = time.monotonic() - t0
        if server.kill is not None and killed is None and elapsed >= duration_s / 2:
            killed, killed_at = server.kill(), round(elapsed, 1)
            logger.info("killed replica %s at %.1f s", killed, elapsed)
        rss.append((round(elapsed, 1), server_metrics(server.url)[1]))
        time.sleep(2.0)
    released = server.release()
    metrics, last_rss = server_metrics(server.url)
    rss.append((round(time.monotonic() - t0, 1), last_rss))
    return {
        "replica_killed": killed,
        "replica_killed_at_s": killed_at,
        "released": released,
        "server_metrics": metrics,
        "rss_mib": rss,
    }


def _differ_from_alone(model, adapters: dict, method: str, records: list[dict]) -> int:
    """How many tokens of the completed ``records`` differ from the same request run alone, greedy,
    on a fresh engine of the same method."""
    engine = precache.Engine(model, adapters=adapters, method=method)
    differ = 0
    for record in records:
        session = engine.session()
        session.append(record["prompt"])
        tokens = session.generate(
            agent=record["agent"], max_new_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        ).token_ids
        differ += sum(a != b for a, b in zip(tokens, record["tokens"], strict=True))
        session.close()
    return differ


def _table(result: dict):
    from rich.table import Table

    where = f"{result['replicas']} replicas" if result.get("replicas") else "one server"
    table = Table(
        title=f"soak: {result['method']}, {where}, {result['duration_s']:g} s, {result['tenants']} tenants"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    for k, v in result["outcomes"].items():
        table.add_row(f"client saw: {k}", str(v))
    for k, v in result["server_metrics"].items():
        if "refused" in k or "errors" in k:
            table.add_row(f"server counted: {k}", f"{v:g}")
    series: dict[str, list[float]] = {}
    for _, by_replica in result["rss_mib"]:
        for replica, mib in by_replica.items():
            series.setdefault(replica, []).append(mib)
    for replica, mib in series.items():
        table.add_row(
            f"RSS MiB of {replica} (first / max / last)", f"{mib[0]:.0f} / {max(mib):.0f} / {mib[-1]:.0f}"
        )
    if result.get("replica_killed"):
        table.add_row(
            "replica killed at (s)", f"{result['replica_killed']} at {result['replica_killed_at_s']:g}"
        )
    table.add_row(
        "stalled readers / slowloris sockets closed",
        f"{result['stalled_readers']} / {result['slowloris_sockets_closed']}",
    )
    table.add_row(
        "tokens differing from the request alone (must be 0)",
        f"{result['tokens_differing_from_alone']} (over {result['checked_alone']} requests)",
    )
    table.add_row(
        f"blocks leaked over {len(result['released'])} live server(s) (must be 0)",
        str(result["blocks_leaked"]),
    )
    return table


def _bench_soak(args: argparse.Namespace) -> int:
    from precache.resources import adapter_set

    for name in ("httpx", "httpx2", "precache.server.access"):  # a line per request: thousands
        logging.getLogger(name).setLevel(logging.WARNING)
    compile = False if args.eager else None
    model = precache.load_model(args.model, compile=compile)
    adapters = adapter_set(args.adapters, ["plan", "action", "reflect"])
    result = run_soak(
        model,
        adapters,
        args.method,
        args.duration,
        args.tenants,
        args.kv_cache_bytes,
        args.seed,
        args.verify_limit,
        replicas=args.replicas,
        model_arg=args.model,
        compile=compile,
    )
    if args.idle_conversations:
        from precache.bench.soak_idle import idle_table, run_idle_phase

        result["idle"] = run_idle_phase(
            model,
            adapters,
            args.method,
            args.idle_conversations,
            args.idle_tokens,
            args.kv_cache_bytes,
            int(args.swap_space * 2**30),
            args.seed,
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    console().print(_table(result))
    clean = result["blocks_leaked"] == 0 and result["sessions_left"] == 0
    if "idle" in result:
        console().print(idle_table(result["idle"]))
        clean = clean and result["idle"]["tokens_differing_after_rebuild"] == 0
    return 0 if clean and result["tokens_differing_from_alone"] == 0 else 1


def add_bench_soak(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``soak`` on the ``precache bench`` sub-parsers."""
    p = bench_sub.add_parser(
        "soak", help="a server (or --replicas N) under mixed, faulty load for a bounded time"
    )
    p.add_argument("--duration", type=positive_float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--tenants", type=positive_int, default=4, help="tenants sending in a loop (default 4)")
    p.add_argument("--method", default="prelrshared", help="sharing method (default prelrshared)")
    p.add_argument("--adapters", default="qv", help="qv | all (committed sets) | DIR with DIR/<agent>/")
    p.add_argument("--model", help="base checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument(
        "--kv-cache-bytes",
        type=positive_int,
        default=64 * 2**20,
        help="the block pool (default 64 MiB: small)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--verify-limit", type=positive_int, default=200, help="completed requests re-run alone (default 200)"
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=None,
        help="serve on N Ray Serve replicas (precache[cluster]) and kill one half-way",
    )
    p.add_argument(
        "--eager", action="store_true", help="run decode steps eagerly (default: one compiled graph per step)"
    )
    p.add_argument(
        "--idle-conversations",
        type=positive_int,
        default=None,
        help="then a phase of N idle conversations on one engine: RSS bounded by --swap-space",
    )
    p.add_argument(
        "--idle-tokens", type=positive_int, default=512, help="prompt tokens of each idle conversation"
    )
    p.add_argument(
        "--swap-space",
        type=positive_float,
        default=0.25,
        metavar="GIB",
        help="host swap space of the idle phase in GiB (default 0.25)",
    )
    p.add_argument("--json", required=True, help="the report")
    p.set_defaults(func=_bench_soak)
