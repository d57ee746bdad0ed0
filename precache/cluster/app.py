"""The Ray Serve application: ``replicas`` × :class:`~precache.cluster.replica.PrecacheReplica`
behind one :class:`~precache.cluster.ingress.PrecacheIngress`, routed by
:class:`~precache.cluster.router.TrajectoryAffinityRouter` (or Ray's default router, to compare),
built from a :class:`~precache.cluster.config.ClusterConfig` and an
:class:`~precache.cluster.config.EngineSpec`, and run by :class:`ClusterServer`.

Request path: client -> Ray's HTTP proxy -> ingress (tokenize, block hashes) -> the handle's
request router (choose a replica) -> replica (``create_app``'s routes, server loop, engine) -> the
response streamed back through the ingress, with the ``x-precache-replica`` header.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import time
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from transformers import AutoConfig, AutoTokenizer

from precache.cluster import NO_FAILURE_SIGNAL_HANDLER
from precache.cluster.config import ClusterConfig, EngineSpec
from precache.cluster.ingress import PrecacheIngress, replica_actor_name, replica_names
from precache.cluster.replica import ForwardedRequest, PrecacheReplica

logger = logging.getLogger(__name__)

APP_NAME = "precache"
REPLICA_DEPLOYMENT = "PrecacheReplica"


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


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_cpus(cluster: ClusterConfig) -> int:
    """CPUs of a local Ray instance: this machine's, and at least what the replicas ask for."""
    return max(os.cpu_count() or 1, math.ceil(cluster.replicas * cluster.num_cpus_per_replica))
