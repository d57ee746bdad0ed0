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
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

import precache
from precache.cli_args import positive_float, positive_int
from precache.terminal import console

logger = logging.getLogger(__name__)

PROMPT_LEN, MAX_TOKENS = 24, 8
STALL_TOKENS = 120


def _parse_sse(lines: list[str]) -> tuple[list[int] | None, tuple[int, str] | None]:
    """``(token ids of a finished choice, (status, code) of an error event)`` of a stream's lines."""
    tokens, error = None, None
    for line in lines:
        if not line.startswith("data: {"):
            continue
        data = json.loads(line.removeprefix("data: "))
        if "error" in data:
            error = (int(data["error"].get("status", 0) or 0), data["error"].get("code") or "none")
        for choice in data.get("choices", []):
            if choice.get("finish_reason") is not None:
                tokens = choice.get("token_ids")
    return tokens, error


class _Soak:
    def __init__(
        self, url: str, agents: list[str], vocab: list[int], tenants: int, seed: int, deadline: float
    ):
        self.url, self.agents, self.vocab, self.deadline = url, agents, vocab, deadline
        self.tenants, self.seed = tenants, seed
        self.lock = threading.Lock()
        self.completed: list[dict] = []  # {agent, prompt, tokens, tenant}
        self.outcomes: dict[str, int] = {}
        self.stalls = self.slowloris_closed = 0

    def _count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def tenant(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        salt = f"soak-tenant-{self.seed}-{index}"
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < self.deadline:
                prompt = [rng.choice(self.vocab) for _ in range(PROMPT_LEN)]
                agent, stream = rng.choice(self.agents), rng.random() < 0.5
                hang_up = stream and rng.random() < 0.2
                body = {
                    "model": agent, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "cache_salt": salt, "return_token_ids": True, "stream": stream,
                }  # fmt: skip
                try:
                    tokens = self._send(client, body, hang_up)
                except httpx.HTTPError as exc:
                    self._count(f"client error {type(exc).__name__}")
                    continue
                if tokens is not None:
                    with self.lock:
                        self.completed.append(
                            {"agent": agent, "prompt": prompt, "tokens": tokens, "tenant": index}
                        )

    def _send(self, client: httpx.Client, body: dict, hang_up: bool) -> list[int] | None:
        if not body["stream"]:
            r = client.post(self.url + "/completions", json=body)
            if r.status_code != 200:
                self._count(f"{r.status_code} {r.json().get('error', {}).get('code')}")
                return None
            self._count("200 whole")
            return r.json()["choices"][0]["token_ids"]
        lines = []
        with client.stream("POST", self.url + "/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                self._count(f"{r.status_code} {r.json().get('error', {}).get('code')}")
                return None
            for line in r.iter_lines():
                lines.append(line)
                if hang_up and sum(1 for x in lines if x.startswith("data: {")) >= 2:
                    self._count("stream hung up by the client")
                    return None
        tokens, error = _parse_sse(lines)
        if error is not None:
            self._count(f"stream error {error[1]}")
            return None
        self._count("200 stream")
        return tokens

    def stalled_reader(self, host: str, port: int, hold_s: float) -> None:
        body = json.dumps(
            {"model": self.agents[0], "prompt": self.vocab[:PROMPT_LEN], "max_tokens": STALL_TOKENS,
             "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 20, "n": 4,
             "cache_salt": f"soak-stalled-{self.seed}"}
        ).encode()  # fmt: skip
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        while time.monotonic() + hold_s < self.deadline:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.connect((host, port))
            sock.sendall(head + body)
            time.sleep(hold_s)  # never read
            sock.close()
            with self.lock:
                self.stalls += 1

    def slowloris(self, host: str, port: int, sockets: int) -> None:
        request = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-length: 10\r\n".encode()
        open_: list[list] = []  # [socket, bytes sent]
        while time.monotonic() < self.deadline:
            while len(open_) < sockets:
                s = socket.create_connection((host, port), timeout=5)
                s.setblocking(False)
                open_.append([s, 0])
            for entry in list(open_):
                s, sent = entry
                try:
                    if sent < len(request):
                        s.send(request[sent : sent + 1])
                        entry[1] += 1
                    if s.recv(4096) == b"":
                        raise ConnectionError
                except BlockingIOError:
                    continue
                except OSError:
                    s.close()
                    open_.remove(entry)
                    with self.lock:
                        self.slowloris_closed += 1
            time.sleep(0.5)
        for s, _ in open_:
            s.close()


def _metrics(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """``(the refusal, error and request counters by sample line, each server process's RSS in MiB
    by replica)`` of ``/metrics`` (one server: replica ``"server"``)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    counters: dict[str, float] = {}
    rss: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("precache_refused_total", "precache_errors_total", "precache_requests_total")):
            name, value = line.rsplit(" ", 1)
            counters[name] = float(value)
        elif line.startswith("process_resident_memory_bytes"):
            name, value = line.rsplit(" ", 1)
            replica = name.split('replica="', 1)[1].split('"', 1)[0] if "replica=" in name else "server"
            rss[replica] = round(float(value) / 2**20, 1)
    return counters, rss


@dataclass
class _Target:
    """The server under soak: its URL, host and port, ``release()`` (each live server's
    :meth:`~precache.server.loop.ServerLoop.release_idle` counts, with ``"replica"``), and
    ``kill()`` (a replica's crash; None for one server) returning the replica killed."""

    url: str
    host: str
    port: int
    release: Callable[[], list[dict]]
    kill: Callable[[], str] | None = None


@contextmanager
def _one_server(model, adapters: dict, method: str, kv_cache_bytes: int | None, config):
    from precache.server import LiveServer, create_app
    from precache.server.connections import ConnectionLimits

    engine = precache.Engine(model, adapters=adapters, method=method, kv_cache_bytes=kv_cache_bytes)
    limits = ConnectionLimits(max_connections=64, header_timeout_s=2.0, body_timeout_s=2.0)
    app = create_app(engine, config)
    with LiveServer(app, limits=limits, shutdown_timeout_s=5) as server:

        def release() -> list[dict]:
            return [{"replica": "server", **app.state.loop.release_idle()}]

        yield _Target(server.url, server.host, server.port, release)


@contextmanager
def _cluster(
    model_arg,
    adapters: dict,
    method: str,
    kv_cache_bytes: int | None,
    config,
    replicas: int,
    compile: bool | None,
):
    from precache.cluster import require_ray

    require_ray()
    from precache.cluster.app import ClusterConfig, ClusterServer, EngineSpec, checkpoint_app, local_cpus
    from precache.models.loader import resolve_checkpoint

    folder = resolve_checkpoint(model_arg)
    folders = {name: str(Path(path).resolve()) for name, path in adapters.items()}
    spec = EngineSpec(str(folder), folders, method, kv_cache_bytes, compile=compile)
    cluster = ClusterConfig(replicas=replicas, num_cpus_per_replica=1.0, shutdown_timeout_s=5.0)
    app = checkpoint_app(folder, spec, config, cluster)
    with ClusterServer(app, port=0, num_cpus=local_cpus(cluster)) as server:
        killed: list[str] = []

        def kill() -> str:
            killed.append(server.replica_ids()[0])
            server.kill_replica(killed[-1])
            return killed[-1]

        def release() -> list[dict]:
            deadline = time.monotonic() + 120  # Ray Serve replaces a killed replica: wait for it
            while time.monotonic() < deadline:
                ids = server.replica_ids()
                if len(ids) == replicas and not set(killed) & set(ids):
                    break
                time.sleep(0.5)
            return server.release_idle()

        yield _Target(server.url, server.host, server.port, release, kill)


def run_soak(model, adapters: dict, method: str, duration_s: float, tenants: int, kv_cache_bytes: int | None, seed: int,
             verify_limit: int, stall_hold_s: float = 20.0, replicas: int | None = None, model_arg=None,
             compile: bool | None = None) -> dict:  # fmt: skip
    """Run the soak described in the module docstring; returns the report (JSON-ready).
    ``model`` is the loaded model (the verification engine's, and one server's); with
    ``replicas``, each replica loads ``model_arg`` (a checkpoint path; None: the embedded model)
    itself, with ``compile`` (None: the compiled decode step on a CPU). ``stall_hold_s``: how long each stalled reader keeps its socket open without reading
    (well past the servers' 2 s stall timeout once its buffers are full)."""
    from precache.server import ServerConfig

    config = ServerConfig(
        model_name="base", stream_buffer_events=16, stream_stall_timeout_s=2.0, max_requests_in_flight=64
    )
    special = set(getattr(model.tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(model.config.vocab_size) if i not in special]
    rss: list[tuple[float, dict[str, float]]] = []
    killed, killed_at = None, None
    if replicas:
        target = _cluster(model_arg, adapters, method, kv_cache_bytes, config, replicas, compile)
    else:
        target = _one_server(model, adapters, method, kv_cache_bytes, config)
    with target as server:
        t0 = time.monotonic()
        soak = _Soak(server.url, list(adapters), vocab, tenants, seed, t0 + duration_s)
        threads = [threading.Thread(target=soak.tenant, args=(i,)) for i in range(tenants)]
        threads.append(
            threading.Thread(target=soak.stalled_reader, args=(server.host, server.port, stall_hold_s))
        )
        threads.append(threading.Thread(target=soak.slowloris, args=(server.host, server.port, 4)))
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            elapsed = time.monotonic() - t0
            if server.kill is not None and killed is None and elapsed >= duration_s / 2:
                killed, killed_at = server.kill(), round(elapsed, 1)
                logger.info("killed replica %s at %.1f s", killed, elapsed)
            rss.append((round(elapsed, 1), _metrics(server.url)[1]))
            time.sleep(2.0)
        released = server.release()
        metrics, last_rss = _metrics(server.url)
        rss.append((round(time.monotonic() - t0, 1), last_rss))
    # every completed request again, alone, on a fresh engine of the same method
    alone_engine = precache.Engine(model, adapters=adapters, method=method)
    checked = soak.completed[:verify_limit]
    differ = 0
    for record in checked:
        session = alone_engine.session()
        session.append(record["prompt"])
        tokens = session.generate(
            agent=record["agent"], max_new_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        ).token_ids
        differ += sum(a != b for a, b in zip(tokens, record["tokens"], strict=True))
        session.close()
    return {
        "method": method,
        "duration_s": duration_s,
        "tenants": tenants,
        "replicas": replicas,
        "replica_killed": killed,
        "replica_killed_at_s": killed_at,
        "kv_cache_bytes": kv_cache_bytes,
        "pool_blocks": {r["replica"]: r["blocks"] for r in released},
        "outcomes": dict(sorted(soak.outcomes.items())),
        "completed": len(soak.completed),
        "checked_alone": len(checked),
        "tokens_differing_from_alone": differ,
        "stalled_readers": soak.stalls,
        "slowloris_sockets_closed": soak.slowloris_closed,
        "server_metrics": metrics,
        "rss_mib": rss,
        "released": released,
        "blocks_leaked": sum(r["blocks"] - r["blocks_free"] for r in released),
        "sessions_left": sum(r["sessions_left"] + r["jobs_left"] for r in released),
    }


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


def _idle_table(idle: dict):
    from rich.table import Table

    table = Table(title=f"idle phase: {idle['conversations']} idle conversations")
    table.add_column("measure")
    table.add_column("value", justify="right")
    usage = idle["swap_usage_idle"]
    for label, value in [
        ("tokens per conversation", idle["tokens_per_conversation"]),
        ("swap space / block pool MiB", f"{idle['swap_space_mib']:g} / {idle['kv_cache_mib']:g}"),
        ("host MiB of one swapped conversation", f"{idle['swapped_conversation_mib']:g}"),
        ("RSS MiB before / peak / growth", f"{idle['rss_before_mib']:.0f} / {idle['rss_peak_mib']:.0f} / "
         f"{idle['rss_growth_mib']:.0f}"),
        ("swapped out / held now / dropped", f"{usage['swap_outs']} / {usage['sessions']} / {usage['drops']}"),
        ("rebuilt tokens (returning conversations)", idle["swap_usage"]["rebuilt_tokens"]),
        ("tokens differing after rebuild (must be 0)", idle["tokens_differing_after_rebuild"]),
    ]:  # fmt: skip
        table.add_row(label, str(value))
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
        from precache.bench.soak_idle import run_idle_phase

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
        console().print(_idle_table(result["idle"]))
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
