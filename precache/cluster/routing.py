"""Trajectory affinity in plain Python (no Ray): prompt block hashes, what each replica holds, and
the placement rule the Ray request router (:mod:`precache.cluster.router`) applies.

A prompt is cut into blocks of ``block_size`` tokens; block i is named by a hash of the tokens
``[0, (i + 1) block_size)`` (a chain: each hash covers its parent), by the engine's own prefix
hash chain (:mod:`precache.cache.prefix`) salted by the request's tenant. Equal hashes mean equal
token prefixes of one tenant, whatever adapter wrote them, so one table serves every agent of a
trajectory. Hashes are BLAKE2b, equal in every process (Python's ``hash`` is salted per process).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from precache.cache.pool import DEFAULT_BLOCK_SIZE
from precache.cache.prefix import chain_hashes

#: tokens per routing block (the router's unit of prefix matching; the engine's KV block by default)
DEFAULT_ROUTING_BLOCK = DEFAULT_BLOCK_SIZE
#: the chain's cache key: the server's session lookup indexes trajectories under the same one
ROUTING_KEY = "trajectory"
_MASK63 = (1 << 63) - 1


def block_hashes(
    token_ids: Sequence[int], block_size: int = DEFAULT_ROUTING_BLOCK, salt: str | None = None
) -> list[int]:
    """Chain hashes of the full blocks of ``token_ids`` under tenant ``salt``: ``out[i]`` names
    ``token_ids[: (i + 1) * block_size]``; a last partial block has no hash. The engine's one hash
    chain (:func:`precache.cache.prefix.chain_hashes`, the one the server's session lookup follows),
    cut to 63 bits for Ray's routing stats; two tenants' chains never meet.

    Raises:
        ValueError: ``block_size`` < 1.
    """
    return [h & _MASK63 for h in chain_hashes(list(token_ids), block_size, ROUTING_KEY, salt)]


@dataclass
class Holdings:
    """What one replica holds: ``blocks``, every block hash of its cached trajectories, and
    ``anchors``, the hash of the last full block of each request prompt it took (a prompt that
    passes through an anchor continues that conversation; one that only shares blocks before it,
    e.g. a common system prompt, is a new trajectory)."""

    blocks: set[int] = field(default_factory=set)
    anchors: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Placement:
    """A routing decision: ``ranks`` of replica keys, most preferred first (the Ray router tries
    the first rank, then the next); ``held`` is True when the prompt continues a trajectory that
    the first rank holds; ``matched_blocks`` the prefix the chosen holders share (blocks)."""

    ranks: list[list[str]]
    held: bool
    matched_blocks: int


class AffinityTable:
    """Per replica: the holdings it last reported (``report``) plus what this router sent it since
    (``record``, kept ``ttl_s`` seconds, until a later report covers it).

    Placement (:meth:`place`), for a prompt's block hashes and each replica's load (requests in
    flight):

    1. held turn: if some replica's longest matching prefix passes through one of its anchors,
       the prompt continues a trajectory there: rank 1 is the replica(s) with the longest match;
       rank 2 the replicas that still take new trajectories, least loaded first (Ray uses rank 2
       only when rank 1 is at ``max_ongoing_requests``: a full holder spills, losing its cache);
    2. new trajectory: the replicas whose load is under ``new_limit``, least loaded first, ties to
       the longest shared prefix, then at random; a replica at or over ``new_limit`` sheds new trajectories while
       it still takes turns of the ones it holds. None under the limit: no rank (the request
       waits in the router and is routed again).
    """

    def __init__(self, ttl_s: float = 30.0, clock=time.monotonic, seed: int | None = None):
        self.ttl_s, self.clock = ttl_s, clock
        self._rng = random.Random(seed)  # breaks ties between equally loaded, equally matching replicas
        self.reported: dict[str, Holdings] = {}
        self._sent: dict[str, dict[int, tuple[float, bool]]] = {}  # hash -> (time, is anchor)

    def report(self, replica: str, blocks: Iterable[int], anchors: Iterable[int]) -> None:
        """Replace what ``replica`` says it holds."""
        self.reported[replica] = Holdings(set(blocks), set(anchors))

    def record(self, replica: str, hashes: Sequence[int]) -> None:
        """This router sent a prompt with ``hashes`` to ``replica``: count it as held there until a
        report can include it."""
        if not hashes:
            return
        sent, now = self._sent.setdefault(replica, {}), self.clock()
        for h in hashes[:-1]:
            sent[h] = (now, sent.get(h, (now, False))[1])
        sent[hashes[-1]] = (now, True)

    def replicas(self) -> set[str]:
        """Replicas the table holds anything for."""
        return set(self.reported) | set(self._sent)

    def forget(self, replica: str) -> None:
        """``replica`` is gone with its caches."""
        self.reported.pop(replica, None)
        self._sent.pop(replica, None)

    def holdings(self, replica: str) -> Holdings:
        """Reported plus recently sent holdings of ``replica`` (expired sends are dropped)."""
        base = self.reported.get(replica, Holdings())
        sent = self._sent.get(replica, {})
        cutoff = self.clock() - self.ttl_s
        for h in [h for h, (t, _) in sent.items() if t < cutoff]:
            del sent[h]
        if not sent:
            return base
        return Holdings(base.blocks | sent.keys(), base.anchors | {h for h, (_, a) in sent.items() if a})

    def match(self, replica: str, hashes: Sequence[int]) -> tuple[int, bool]:
        """``(blocks of the longest held prefix, whether that prefix passes through an anchor)``."""
        held = self.holdings(replica)
        n, anchored = 0, False
        for h in hashes:
            if h not in held.blocks:
                break
            n += 1
            anchored = anchored or h in held.anchors
        return n, anchored

    def place(self, hashes: Sequence[int], loads: dict[str, int], new_limit: float) -> Placement:
        """Ranks of the replicas in ``loads`` (replica -> requests in flight) for a prompt with block
        ``hashes``; see the class docstring."""
        matches = {r: self.match(r, hashes) for r in loads}
        tie = {r: self._rng.random() for r in loads}
        open_for_new = sorted(
            (r for r in loads if loads[r] < new_limit), key=lambda r: (loads[r], -matches[r][0], tie[r])
        )
        best = max((n for n, anchored in matches.values() if anchored), default=0)
        if best:
            holders = sorted(r for r, (n, anchored) in matches.items() if anchored and n == best)
            rest = [r for r in open_for_new if r not in holders]
            return Placement([holders, rest] if rest else [holders], True, best)
        return Placement([open_for_new] if open_for_new else [], False, 0)
