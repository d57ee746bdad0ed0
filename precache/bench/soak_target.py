"""The server ``precache bench soak`` (:mod:`precache.bench.soak`) runs against: one server in
this process with a small block pool and tight client limits, or ``precache serve --replicas N``
on a local Ray instance; and the counters and RSS it reads from the server's ``/metrics``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

import precache

#: the ``/metrics`` counters the soak reports
COUNTERS = ("precache_refused_total", "precache_errors_total", "precache_requests_total")


@dataclass
class Target:
    """The server under soak: its URL, host and port, ``release()`` (each live server's
    :meth:`~precache.server.loop.ServerLoop.release_idle` counts, with ``"replica"``), and
    ``kill()`` (a replica's crash; None for one server) returning the replica killed."""

    url: str
    host: str
    port: int
    release: Callable[[], list[dict]]
    kill: Callable[[], str] | None = None


def server_metrics(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """``(the refusal, error and request counters by sample line, each server process's RSS in MiB
    by replica)`` of ``/metrics`` (one server: replica ``"server"``)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    counters: dict[str, float] = {}
    rss: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(COUNTERS):
            name, value = line.rsplit(" ", 1)
            counters[name] = float(value)
        elif line.startswith("process_resident_memory_bytes"):
            name, value = line.rsplit(" ", 1)
            replica = name.split('replica="', 1)[1].split('"', 1)[0] if "replica=" in name else "server"
            rss[replica] = round(float(value) / 2**20, 1)
    return counters, rss


@contextmanager
def one_server(model, adapters: dict, method: str, kv_cache_bytes: int | None, config) -> Iterator[Target]:
    """``precache serve``'s app on loopback in this process (:class:`~precache.server.live.LiveServer`),
    at most 64 connections, headers and body each within 2 s; ``config`` is its ``ServerConfig``."""
    from precache.server import LiveServer, create_app
    from precache.server.connections import ConnectionLimits

    engine = precache.Engine(model, adapters=adapters, method=method, kv_cache_bytes=kv_cache_bytes)
    limits = ConnectionLimits(max_connections=64, header_timeout_s=2.0, body_timeout_s=2.0)
    app = create_app(engine, config)
    with LiveServer(app, limits=limits, shutdown_timeout_s=5) as server:

        def release() -> list[dict]:
            return [{"replica": "server", **app.state.loop.release_idle()}]

        yield Target(server.url, server.host, server.port, release)


@contextmanager
def cluster(
    model_arg,
    adapters: dict,
    method: str,
    kv_cache_bytes: int | None,
    config,
    replicas: int,
    compile: bool | None,
) -> Iterator[Target]:
    """``precache serve --replicas N`` on a local Ray instance, each replica loading ``model_arg``
    (a checkpoint path; None: the embedded model) on one CPU; ``kill()`` kills the first replica,
    and ``release()`` first waits (at most 120 s) for Ray Serve to replace it.

    Raises:
        MissingExtraError: Ray Serve is not installed (``precache[cluster]``).
    """
    from precache.cluster import require_ray

    require_ray()
    from precache.cluster.app import ClusterServer, checkpoint_app, local_cpus
    from precache.cluster.config import ClusterConfig, EngineSpec
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

        yield Target(server.url, server.host, server.port, release, kill)
