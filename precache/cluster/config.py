"""What a cluster is built from: :class:`ClusterConfig` (how replicas are placed and requests
routed) and :class:`EngineSpec` (the picklable recipe each replica builds its engine from). Plain
data, no Ray: the command line checks them before Ray is imported."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import precache
from precache.cluster.routing import DEFAULT_ROUTING_BLOCK

#: the request routers a cluster can use: trajectory affinity, or Ray's default (to compare)
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
