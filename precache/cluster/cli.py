"""``precache serve --replicas N | --ray-address ADDR``: the scale-out flags of ``precache serve``.

:mod:`precache.server.cli` owns ``serve`` and runs it in one process; this module, registered
after it, adds the scale-out flags to that parser and runs the command on Ray Serve when they
ask for it (so the server never imports the cluster). Ray stays an optional extra: it is imported
only when a cluster is asked for.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from precache.cluster import NO_FAILURE_SIGNAL_HANDLER, cluster_requested
from precache.errors import PrecacheError

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


def _serve_or_scale_out(single_process: Callable[[argparse.Namespace], int]):
    def run(args: argparse.Namespace) -> int:
        if getattr(args, "replicas", None) is not None or getattr(args, "ray_address", None) is not None:
            # read by Ray when it is imported (cluster_requested imports it): without it, a SIGTERM
            # before our handler is in place prints Ray's native stack dump and aborts (issue 24)
            os.environ.setdefault(NO_FAILURE_SIGNAL_HANDLER, "1")
        if not cluster_requested(args):
            return single_process(args)
        refuse_single_process_flags(args)
        from precache.cluster.app import serve_from_args  # ray: present, cluster_requested checked

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
