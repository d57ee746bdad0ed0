"""``precache serve --replicas N | --ray-address ADDR``: the scale-out flags of ``precache serve``.

:mod:`precache.server.cli` owns ``serve`` and runs it in one process; this module, registered
after it, adds the scale-out flags to that parser and runs the command on Ray Serve when they
ask for it (so the server never imports the cluster). Ray stays an optional extra: it is imported
only when a cluster is asked for.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from precache.cluster import NO_FAILURE_SIGNAL_HANDLER, cluster_requested
from precache.cluster.config import ClusterConfig, EngineSpec
from precache.errors import PrecacheError
from precache.models.loader import checkpoint_name, resolve_checkpoint
from precache.server.args import adapters_from_args, api_keys_from_args, server_config_from_args

logger = logging.getLogger(__name__)

#: ``serve``'s connection limits and their defaults (:class:`~precache.server.connections.ConnectionLimits`)
CONNECTION_FLAGS = (
    ("--max-connections", "max_connections", 1024),
    ("--header-timeout", "header_timeout", 10.0),
    ("--body-timeout", "body_timeout", 30.0),
)


def refuse_single_process_flags(args: argparse.Namespace) -> None:
    """The flags a cluster does not apply: adapters loaded at run time (each replica would need
    them) and the connection limits (connections end at Ray Serve's HTTP proxy, which precache's
    limits do not reach): refused, never dropped. The security flags (keys, request size, special
    tokens) are applied at the ingress.

    Raises:
        PrecacheError: one of them is given; the message names them.
    """
    given = [
        flag
        for flag, on in (
            ("--enable-runtime-lora", getattr(args, "enable_runtime_lora", False)),
            ("--max-loras", getattr(args, "max_loras", None) is not None),
            ("--max-lora-rank", getattr(args, "max_lora_rank", None) is not None),
            *((flag, getattr(args, attr, default) != default) for flag, attr, default in CONNECTION_FLAGS),
        )
        if on
    ]
    if given:
        raise PrecacheError(f"{', '.join(given)}: not supported with --replicas / --ray-address yet")


class _Stopped(Exception):
    """SIGTERM arrived: ``serve_from_args`` leaves its ``with`` block, which stops Ray Serve and the
    Ray instance it started (without it the process died with Ray's agents left running)."""


class _StopSignal:
    def __call__(self, signum, frame) -> None:
        raise _Stopped


def serve_from_args(args) -> int:
    """``precache serve --replicas N | --ray-address ADDR``: load the tokenizer here, the engines
    in the replicas, and serve until interrupted (SIGTERM as Ctrl-C: Ray Serve and the Ray instance
    it started are shut down). Needs Ray Serve: call it once :func:`cluster_requested` said yes."""
    from precache.cluster.app import ClusterServer, checkpoint_app, local_cpus  # ray

    folder = resolve_checkpoint(args.model)
    name = args.served_model_name or Path(checkpoint_name(folder)).name
    server_config = server_config_from_args(args, name, api_keys_from_args(args))
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


def _serve_or_scale_out(single_process: Callable[[argparse.Namespace], int]):
    def run(args: argparse.Namespace) -> int:
        if getattr(args, "replicas", None) is not None or getattr(args, "ray_address", None) is not None:
            # read by Ray when it is imported (cluster_requested imports it): without it, a SIGTERM
            # before our handler is in place prints Ray's native stack dump and aborts (issue 24)
            os.environ.setdefault(NO_FAILURE_SIGNAL_HANDLER, "1")
        if not cluster_requested(args):
            return single_process(args)
        refuse_single_process_flags(args)
        return serve_from_args(args)

    return run


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``--replicas``, ``--ray-address``, ``--num-cpus-per-replica`` and
    ``--num-gpus-per-replica`` to ``precache serve`` (registered before by :mod:`precache.server.cli`)."""
    serve = sub.choices["serve"]
    serve.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="N engine replicas on Ray Serve (pip install precache[cluster])",
    )
    serve.add_argument("--ray-address", default=None, help="join this Ray cluster (auto, HOST:6379) instead")
    serve.add_argument(
        "--num-cpus-per-replica", type=float, default=None, help="Ray CPUs per replica (default 1)"
    )
    serve.add_argument(
        "--num-gpus-per-replica", type=float, default=None, help="Ray GPUs per replica (default 0)"
    )
    serve.set_defaults(func=_serve_or_scale_out(serve.get_default("func")))
