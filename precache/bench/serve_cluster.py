"""``precache bench serve --replicas N --router affinity,default``: the serving benchmark on Ray
Serve. For each sharing method and router, the same load (N trajectories of a trace, replayed with
:mod:`precache.bench.loadgen`) runs against a fresh cluster of ``replicas`` engines
(:mod:`precache.cluster`), one router after the other in one run, so the routers are compared on
one machine state. Each summary adds the sum of prefill tokens and how many turns moved replica.
"""

from __future__ import annotations

import asyncio
import logging

from precache.bench.trace import Trace
from precache.cluster import require_ray
from precache.server.config import ServerConfig

logger = logging.getLogger(__name__)


def run_cluster_bench(
    model,
    adapters: dict[str, str],
    methods: list[str],
    routers: list[str],
    replicas: int,
    qps_levels: list[float],
    sessions: int,
    trace: Trace,
    model_name: str = "base",
    seed: int = 0,
    num_cpus_per_replica: float = 1.0,
) -> dict:
    """Every (method, router) at every request rate on a fresh cluster each; ``model`` is the loaded
    model (its checkpoint folder goes to the replicas, its tokenizer to the ingress).

    Returns ``{"trace", "sessions", "qps", "replicas", "methods": {"method@router": {qps:
    summary}}}`` with :func:`~precache.bench.loadgen.summarize`'s summaries (times in seconds).

    Raises:
        MissingExtraError: ``ray[serve]`` is not installed.
    """
    require_ray()
    import ray  # the optional extra, checked just above

    from precache.cluster.app import free_port, local_cpus
    from precache.cluster.config import ClusterConfig

    started = not ray.is_initialized()
    if started:
        cpus = local_cpus(ClusterConfig(replicas=replicas, num_cpus_per_replica=num_cpus_per_replica))
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    result: dict = {"trace": trace.name, "sessions": sessions, "qps": qps_levels, "replicas": replicas}
    result["methods"] = {}
    port = free_port("127.0.0.1")  # Serve's HTTP proxy keeps the port of the first application
    try:
        for method in methods:
            for router in routers:
                cluster = ClusterConfig(
                    replicas=replicas, router=router, num_cpus_per_replica=num_cpus_per_replica
                )
                result["methods"][f"{method}@{router}"] = {
                    str(qps): _run_level(
                        model, adapters, method, cluster, trace, sessions, qps, model_name, seed, port
                    )
                    for qps in qps_levels
                }
    finally:
        if started:
            ray.shutdown()
    return result


def _run_level(model, adapters, method, cluster, trace, sessions, qps, model_name, seed, port) -> dict:
    """One (method, router) at one request rate on a fresh cluster: the summary of the replay."""
    from precache.bench.loadgen import replay, summarize  # the openai client (a test extra)
    from precache.cluster.app import ClusterServer, build_app  # ray
    from precache.cluster.config import EngineSpec

    spec = EngineSpec(str(model.path), adapters, method)
    app = build_app(
        spec,
        model.tokenizer,
        model.config.vocab_size,
        model.max_context,
        ServerConfig(model_name=model_name),
        cluster,
    )
    with ClusterServer(app, port=port) as server:
        asyncio.run(_warm_up(server.url, trace.agents[0], cluster.replicas))
        special = set(getattr(model.tokenizer, "all_special_ids", []) or []) | _eos_ids(model)
        records, wall = asyncio.run(
            replay(server.url, trace, sessions, qps, model.config.vocab_size, special, seed)
        )
    s = summarize(records, wall)
    logger.info(
        "%s, %s router @ %.2f req/s: TTFT p50 %.3f s, p90 %.3f s; %.1f tok/s; cached %.0f%%; "
        "%d prefill tokens; %d replica moves; %d errors",
        method,
        cluster.router,
        qps,
        s["ttft_p50_s"],
        s["ttft_p90_s"],
        s["throughput_tok_s"],
        100 * s["cached_ratio"],
        s["prefill_tokens"],
        s["replica_moves"],
        s["errors"],
    )
    return s


def _eos_ids(model) -> set[int]:
    eos = getattr(model.hf_config, "eos_token_id", None)
    return set(eos) if isinstance(eos, list | tuple) else {eos} if isinstance(eos, int) else set()


async def _warm_up(base_url: str, agent: str, replicas: int) -> None:
    """Short requests from several new trajectories at once, so every replica pays its lazy
    initialisation before the measured load (they spread as new trajectories do)."""
    import openai  # a test extra

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        await asyncio.gather(
            *(
                client.completions.create(model=agent, prompt=[7 + k] * 8, max_tokens=2, temperature=0)
                for k in range(2 * replicas)
            )
        )
