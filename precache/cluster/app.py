"""The Ray Serve application: ``replicas`` × :class:`~precache.cluster.replica.PrecacheReplica`
behind one :class:`~precache.cluster.ingress.PrecacheIngress`, routed by
:class:`~precache.cluster.router.TrajectoryAffinityRouter` (or Ray's default router, to compare).

Request path: client -> Ray's HTTP proxy -> ingress (tokenize, block hashes) -> the handle's
request router (choose a replica) -> replica (``create_app``'s routes, server loop, engine) -> the
response streamed back through the ingress, with the ``x-precache-replica`` header.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from ray import serve
from ray.serve.config import RequestRouterConfig
from transformers import AutoConfig, AutoTokenizer

import precache
from precache.cluster import NO_FAILURE_SIGNAL_HANDLER
from precache.cluster.ingress import PrecacheIngress, replica_actor_name, replica_names
from precache.cluster.replica import ForwardedRequest, PrecacheReplica
from precache.cluster.routing import DEFAULT_ROUTING_BLOCK
from precache.models.loader import checkpoint_name, resolve_checkpoint
from precache.server.cli import adapters_from_args, api_keys_from_args
from precache.server.config import ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "precache"
REPLICA_DEPLOYMENT = "PrecacheReplica"
ROUTERS = ("affinity", "default")


@dataclass(frozen=True)
class ClusterConfig:
    """How the cluster places replicas and routes requests.

    ``replicas``: engine replicas; ``router``: ``"affinity"`` (trajectory affinity) or ``"default"``
    (Ray's power-of-two-choices router); ``routing_block``: tokens per routing block;
    ``max_ongoing_requests``: requests one replica takes at once (more wait in the router);
    ``new_trajectory_limit``: requests in flight at which a replica stops taking new trajectories
    (None: three quarters of ``max_ongoing_requests``); ``stats_period_s``: seconds between
    replicas' routing reports; ``attempts``: tries of a request whose replica dies before
    answering; ``num_cpus_per_replica`` / ``num_gpus_per_replica``: Ray resources of a replica;
    ``shutdown_timeout_s``: seconds a stopping replica waits for its running requests (Ray's
    ``graceful_shutdown_timeout_s``).

    Raises:
        ValueError: a field out of range (named in the message).
    """

    replicas: int = 2
    router: str = "affinity"
    routing_block: int = DEFAULT_ROUTING_BLOCK
    max_ongoing_requests: int = 32
    new_trajectory_limit: int | None = None
    stats_period_s: float = 1.0
    attempts: int = 3
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    shutdown_timeout_s: float = 30.0

    def __post_init__(self):
        checks = [
            (self.replicas >= 1, "replicas must be at least 1"),
            (self.router in ROUTERS, f"router must be one of {', '.join(ROUTERS)}"),
            (self.routing_block >= 1, "routing_block must be at least 1"),
            (self.max_ongoing_requests >= 1, "max_ongoing_requests must be at least 1"),
            (
                self.new_trajectory_limit is None
                or 1 <= self.new_trajectory_limit <= self.max_ongoing_requests,
                "new_trajectory_limit must be in [1, max_ongoing_requests]",
            ),
            (self.stats_period_s > 0, "stats_period_s must be > 0"),
            (self.attempts >= 1, "attempts must be at least 1"),
            (self.shutdown_timeout_s >= 0, "shutdown_timeout_s must be >= 0"),
            (self.num_cpus_per_replica >= 0 and self.num_gpus_per_replica >= 0, "resources must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self}")

    @property
    def new_limit(self) -> int:
        """Requests in flight at which a replica sheds new trajectories."""
        if self.new_trajectory_limit is not None:
            return self.new_trajectory_limit
        return max(1, (3 * self.max_ongoing_requests) // 4)


@dataclass(frozen=True)
class EngineSpec:
    """A picklable recipe of a replica's engine, built in the replica's process: ``model`` (an HF
    checkpoint folder), ``adapters`` (name -> folder), and the engine's options."""

    model: str
    adapters: dict[str, str] = field(default_factory=dict)
    method: str = "prelrshared"
    kv_cache_bytes: int | None = None
    dtype: str | None = None  # a torch dtype name; None: the loader's default
    device: str | None = None
    quantization: str | None = None  # "int8": int8 weight-only (precache.models.quant)
    compile: bool | None = None  # the compiled decode step (precache.models.step_graph); None: on a CPU
    kv_cache_dtype: str = "auto"  # the block pool's dtype (precache.models.quant.resolve_kv_cache_dtype)
    swap_space_bytes: int | None = None  # each replica's host swap space (None: a quarter of RAM)

    def __call__(self):
        dtype = getattr(torch, self.dtype) if self.dtype else None
        model = precache.load_model(
            self.model,
            dtype=dtype,
            device=self.device,
            quantization=self.quantization,
            compile=self.compile,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return precache.Engine(
            model,
            adapters=self.adapters,
            method=self.method,
            kv_cache_bytes=self.kv_cache_bytes,
            swap_space_bytes=self.swap_space_bytes,
        )


def build_app(
    engine_factory, tokenizer, vocab_size: int, max_context: int, server_config, cluster: ClusterConfig
):
    """The Serve application (not yet running): ``engine_factory()`` builds each replica's engine;
    ``tokenizer``, ``vocab_size`` and ``max_context`` (tokens) let the ingress tokenize prompts as
    the replicas do; ``server_config`` is every replica's
    :class:`~precache.server.config.ServerConfig`, except its security, which the ingress applies
    for the whole cluster: ``api_keys`` (checked there, so the replicas get no key, only the
    fingerprint of the one that authenticated each request), ``max_request_bytes`` and
    ``trust_client_special_tokens`` (the ingress tokenizes prompts as the replicas do)."""
    router = RequestRouterConfig(request_routing_stats_period_s=cluster.stats_period_s)
    if cluster.router == "affinity":
        router = RequestRouterConfig(
            request_router_class="precache.cluster.router.TrajectoryAffinityRouter",
            request_router_kwargs={
                "new_limit": cluster.new_limit,
                "ttl_s": max(30.0, 5 * cluster.stats_period_s),
            },
            request_routing_stats_period_s=cluster.stats_period_s,
        )
    replica = serve.deployment(
        PrecacheReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=cluster.replicas,
        max_ongoing_requests=cluster.max_ongoing_requests,
        ray_actor_options={
            "num_cpus": cluster.num_cpus_per_replica,
            "num_gpus": cluster.num_gpus_per_replica,
        },
        request_router_config=router,
        graceful_shutdown_timeout_s=cluster.shutdown_timeout_s,
    )
    ingress = serve.deployment(
        PrecacheIngress,
        name="PrecacheIngress",
        num_replicas=1,
        max_ongoing_requests=10_000,  # it only relays: the replicas' limits apply
        ray_actor_options={"num_cpus": 0},
    )
    replica_config = dataclasses.replace(server_config, api_keys=())  # keys stay at the ingress
    return ingress.bind(
        replica.bind(engine_factory, replica_config, cluster.routing_block),
        tokenizer,
        vocab_size,
        max_context,
        server_config.trust_client_special_tokens,
        cluster.routing_block,
        cluster.attempts,
        server_config.api_keys,
        server_config.max_request_bytes,
    )


def checkpoint_app(folder: Path, spec: EngineSpec, server_config, cluster: ClusterConfig):
    """:func:`build_app` for the HF checkpoint ``folder`` that ``spec`` loads in each replica: its
    tokenizer (none without ``tokenizer_config.json``: token-id prompts only), vocabulary and
    context length read here."""
    tokenizer = (
        AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").is_file() else None
    )
    hf_config = AutoConfig.from_pretrained(folder)
    return build_app(
        spec, tokenizer, hf_config.vocab_size, hf_config.max_position_embeddings, server_config, cluster
    )


class ClusterServer:
    """``with ClusterServer(app, port=0) as server: server.url`` runs ``app`` on Ray Serve: it joins
    the cluster at ``ray_address`` or starts a local Ray instance (``num_cpus``: its CPUs; by
    default this machine's), serves HTTP on ``host:port`` (0: a free port), and on exit deletes
    the application (and shuts down the Ray instance it started)."""

    def __init__(
        self, app, host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None, **init
    ):
        self.app, self.host, self.port, self.ray_address, self.init = app, host, port, ray_address, init
        self._started_ray = False

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> ClusterServer:
        if not ray.is_initialized():
            options = {"include_dashboard": False, "log_to_driver": False, **self.init}
            if self.ray_address is None:
                # the processes of the instance we start: no native stack dump on SIGTERM (this
                # process's own handler is off only when set before ray is imported: cli.py)
                os.environ.setdefault(NO_FAILURE_SIGNAL_HANDLER, "1")
            self._started_ray = self.ray_address is None
            ray.init(address=self.ray_address, **options)
        if self.port == 0:
            self.port = free_port(self.host)
        serve.start(http_options={"host": self.host, "port": self.port})
        serve.run(self.app, name=APP_NAME, route_prefix="/")
        return self

    def replica_ids(self) -> list[str]:
        """The Ray Serve ids of the engine replicas now (as the ``x-precache-replica`` header)."""
        return replica_names(APP_NAME, REPLICA_DEPLOYMENT)

    def kill_replica(self, replica_id: str) -> None:
        """Kill replica ``replica_id``'s actor, as a crash would (Ray Serve starts another)."""
        name = replica_actor_name(APP_NAME, REPLICA_DEPLOYMENT, replica_id)
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def release_idle(self, timeout_s: float = 120.0) -> list[dict]:
        """Each replica's :meth:`~precache.cluster.replica.PrecacheReplica.release_idle`, in turn.

        Raises:
            TimeoutError: a replica was not reachable through the router within ``timeout_s``
                seconds (a new replica joins the router's list a moment after its actor exists).
        """
        handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, APP_NAME)
        deadline = time.monotonic() + timeout_s
        counts = []
        for replica in self.replica_ids():
            while True:
                answer = handle.release_idle.remote(ForwardedRequest("GET", "", replica=replica)).result(
                    timeout_s=timeout_s
                )
                if answer["replica"] == replica:  # else the router did not know it yet: another answered
                    counts.append(answer)
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {replica} not reachable through the router")
                time.sleep(0.5)
        return counts

    def stop(self) -> None:
        """Delete the application, and shut down the Ray instance this server started; safe after
        a start that a signal cut short (whatever was not started is skipped)."""
        if ray.is_initialized():
            try:
                serve.delete(APP_NAME)
            except Exception:  # not deployed yet (a stop during start-up): nothing to delete
                logger.debug("no application to delete", exc_info=True)
            if self._started_ray:
                serve.shutdown()
        if self._started_ray:
            ray.shutdown()  # also the processes of an init that a signal cut short

    def __enter__(self) -> ClusterServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Stopped(Exception):
    """SIGTERM arrived: ``serve_from_args`` leaves its ``with`` block, which stops Ray Serve and the
    Ray instance it started (without it the process died with Ray's agents left running)."""


class _StopSignal:
    def __call__(self, signum, frame) -> None:
        raise _Stopped


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_cpus(cluster: ClusterConfig) -> int:
    """CPUs of a local Ray instance: this machine's, and at least what the replicas ask for."""
    return max(os.cpu_count() or 1, math.ceil(cluster.replicas * cluster.num_cpus_per_replica))


def serve_from_args(args) -> int:
    """``precache serve --replicas N | --ray-address ADDR``: load the tokenizer here, the engines
    in the replicas, and serve until interrupted."""
    folder = resolve_checkpoint(args.model)
    server_config = ServerConfig(
        model_name=args.served_model_name or Path(checkpoint_name(folder)).name,
        max_running=args.max_num_seqs,
        max_step_tokens=args.max_num_batched_tokens,
        tool_call_parser=args.tool_call_parser,
        stream_buffer_events=args.stream_buffer_events,
        stream_stall_timeout_s=args.stream_stall_timeout,
        max_requests_in_flight=args.max_requests_in_flight,
        api_keys=api_keys_from_args(args),
        max_request_bytes=args.max_request_bytes,
        trust_client_special_tokens=args.trust_client_special_tokens,
    )
    adapters = {name: str(Path(p).resolve()) for name, p in adapters_from_args(args).items()}
    gpus = args.num_gpus_per_replica or 0.0
    device = args.device or ("cuda" if gpus > 0 else None)
    spec = EngineSpec(
        str(folder),
        adapters,
        args.method,
        args.kv_cache_bytes,
        args.dtype,
        device,
        args.quantization,
        False if args.eager else None,
        args.kv_cache_dtype,
        args.swap_space,
    )
    cluster = ClusterConfig(
        replicas=args.replicas or 1,
        num_cpus_per_replica=1.0 if args.num_cpus_per_replica is None else args.num_cpus_per_replica,
        num_gpus_per_replica=gpus,
        max_ongoing_requests=args.max_num_seqs,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    app = checkpoint_app(folder, spec, server_config, cluster)
    init = {} if args.ray_address else {"num_cpus": local_cpus(cluster)}
    server = ClusterServer(app, args.host, args.port, args.ray_address, **init)
    # SIGTERM as Ctrl-C, from the start (a stop during start-up too): leave, shutting Ray down
    signal.signal(signal.SIGTERM, _StopSignal())
    try:
        server.start()
        signal.signal(signal.SIGTERM, _StopSignal())  # again: ray.init may have put its own
        logger.info(
            "serving %s on %d replicas (%s router) at %s",
            server_config.model_name,
            cluster.replicas,
            cluster.router,
            server.url,
        )
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, _Stopped, SystemExit) as exc:
        # ray.init's own SIGTERM handler, in place while it starts Ray, exits with the signal number
        if isinstance(exc, SystemExit) and exc.code != signal.SIGTERM:
            raise
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the shutdown
            signal.signal(sig, signal.SIG_IGN)
        logger.info("stopping")
    finally:
        server.stop()
    return 0
