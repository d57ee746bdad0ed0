"""The Ray Serve request router with trajectory affinity across adapters.

It sits in the ingress process, inside the ingress's handle to the replica deployment: every
request the ingress forwards passes :meth:`TrajectoryAffinityRouter.choose_replicas`, which reads
the prompt's block hashes from the :class:`~precache.cluster.replica.ForwardedRequest` and ranks
the replicas with :class:`~precache.cluster.routing.AffinityTable` (the rules are there). Ray then
sends the request to the least loaded replica of the first rank that is under its
``max_ongoing_requests``, else of the next rank.

What each replica holds comes from two sources: its own report (``record_routing_stats``, polled
by Ray every ``request_routing_stats_period_s``) and the prompts this router sent it since, so a
conversation's next turn finds its replica before the next report. A replica that dies is
forgotten with its caches: its trajectories' next turns are placed as new ones.
"""

from __future__ import annotations

import logging
import math

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from precache.cluster.replica import ForwardedRequest
from precache.cluster.routing import AffinityTable

logger = logging.getLogger(__name__)


class TrajectoryAffinityRouter(RequestRouter):
    """A request goes to the replica holding the longest cached token prefix of its prompt, whatever
    adapter wrote it; a new trajectory to the least loaded replica under ``new_limit`` requests in
    flight. Configured through ``request_router_kwargs`` (:meth:`initialize_state`)."""

    def initialize_state(self, new_limit: int = 24, ttl_s: float = 30.0, **_):
        """``new_limit``: requests in flight at which a replica stops taking new trajectories (turns
        of trajectories it holds still come, up to ``max_ongoing_requests``); ``ttl_s``: seconds a
        sent prompt counts as held without a report confirming it."""
        self.new_limit = new_limit
        self.table = AffinityTable(ttl_s)
        self._seen_stats: dict[ReplicaID, dict] = {}
        self._in_flight: dict[ReplicaID, int] = {}
        self._routed: dict[str, ReplicaID] = {}  # internal request id -> replica, until it completes

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        for r in candidate_replicas:
            self._refresh(r)
        forwarded = _forwarded(pending_request)
        if forwarded is not None and forwarded.replica is not None:
            # a request for one replica (the ingress's /metrics); gone: any, its answer names it
            target = by_key.get(forwarded.replica)
            return [[target]] if target is not None else [list(candidate_replicas)]
        hashes = forwarded.hashes if forwarded is not None else ()
        loads = {key: self._load(r) for key, r in by_key.items()}
        # only generation requests start trajectories; /health or /v1/models never wait for room
        generation = forwarded is not None and forwarded.method == "POST"
        placement = self.table.place(hashes, loads, self.new_limit if generation else math.inf)
        if pending_request is not None:
            # no rank now: back off before asking again (Ray re-asks at once otherwise)
            pending_request.routing_context.should_backoff = True
        return [[by_key[key] for key in rank] for rank in placement.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        forwarded = _forwarded(pending_request)
        self.table.record(replica_id.unique_id, forwarded.hashes if forwarded is not None else ())
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        self._routed[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._routed.pop(internal_request_id, None) is not None:
            self._in_flight[replica_id] = max(0, self._in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)
        logger.warning("replica %s died: its trajectories will be placed again", replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]):
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        for replica_id in (set(self._in_flight) | set(self._seen_stats)) - current:
            self._forget(replica_id)
        for key in self.table.replicas() - {r.unique_id for r in current}:
            self.table.forget(key)

    def _forget(self, replica_id: ReplicaID) -> None:
        self.table.forget(replica_id.unique_id)
        self._seen_stats.pop(replica_id, None)
        self._in_flight.pop(replica_id, None)

    def _refresh(self, replica: RunningReplica) -> None:
        """Take the replica's latest report into the table (once per report)."""
        stats = replica.routing_stats or {}
        if "blocks" in stats and self._seen_stats.get(replica.replica_id) is not stats:
            self._seen_stats[replica.replica_id] = stats
            self.table.report(replica.replica_id.unique_id, stats["blocks"], stats.get("anchors", ()))

    def _load(self, replica: RunningReplica) -> int:
        """Requests in flight on ``replica``: this router's own count, or Ray's cached queue length
        when that is larger (other routers send there too)."""
        cached = self._replica_queue_len_cache.get(replica.replica_id)
        return max(self._in_flight.get(replica.replica_id, 0), cached or 0)


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    for arg in pending_request.args if pending_request is not None else ():
        if isinstance(arg, ForwardedRequest):
            return arg
    return None
