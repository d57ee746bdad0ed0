"""Scale-out on Ray Serve: N replicas, each one precache engine behind the same API as
``precache serve``, behind one OpenAI endpoint whose request router keeps every turn of a
trajectory, whichever agent takes it, on the replica that holds its caches.

Modules: ``routing`` (block hashes and the placement rule, plain Python), ``router`` (the Ray
``RequestRouter``), ``replica`` (the replica deployment over ``create_app``), ``ingress`` (the
HTTP ingress that tokenizes for routing and relays), ``config`` (``ClusterConfig`` and the
replicas' ``EngineSpec``, plain data), ``app`` (the Serve application and ``ClusterServer``),
``cli`` (``precache serve --replicas``). Ray is an optional extra: this package imports it only in
the modules that need it, and :func:`require_ray` says how to install it.
"""

from __future__ import annotations

from precache.errors import PrecacheError

RAY_MISSING = 'scale-out needs Ray Serve: pip install "precache[cluster]"'


#: Ray's switch for its native failure signal handler (a stack dump, then an abort, on SIGTERM);
#: Ray reads it when it is imported, in this process and in the processes it starts
NO_FAILURE_SIGNAL_HANDLER = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


class MissingExtraError(PrecacheError, ImportError):
    """An optional extra that a command needs is not installed."""


class ClusterArgumentError(PrecacheError, ValueError):
    """Scale-out flags that do not go together."""


def require_ray() -> None:
    """Check that ``ray[serve]`` is importable.

    Raises:
        MissingExtraError: it is not (the message says how to install it).
    """
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(RAY_MISSING) from exc


def cluster_requested(args) -> bool:
    """Whether ``precache serve`` was asked to scale out (``--replicas`` or ``--ray-address``).

    Raises:
        MissingExtraError: it was, and ``ray[serve]`` is not installed.
        ClusterArgumentError: ``--replicas`` < 1, or a per-replica flag without either.
    """
    wanted = args.replicas is not None or args.ray_address is not None
    if args.replicas is not None and args.replicas < 1:
        raise ClusterArgumentError(f"--replicas must be at least 1, got {args.replicas}")
    if not wanted:
        for flag in ("num_cpus_per_replica", "num_gpus_per_replica"):
            if getattr(args, flag) is not None:
                name = "--" + flag.replace("_", "-")
                raise ClusterArgumentError(f"{name} needs --replicas N or --ray-address ADDR")
        return False
    require_ray()
    return True
