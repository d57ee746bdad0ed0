"""The cluster's ``/metrics``: every replica's Prometheus metrics in one exposition, each sample
labelled with the replica that counted it (``replica="<Ray Serve replica id>"``), plus the
ingress's own: the requests it refused itself (``precache_errors_total{replica="ingress"}``: a
missing or wrong API key, a body over ``--max-request-bytes``, no replica left) and how many
replicas answered this scrape (``precache_cluster_replicas_reporting``).

Prometheus sums across the ``replica`` label (``sum without (replica) (...)``) for the cluster's
totals; the label keeps a dead or slow replica visible. Parsing and writing the text format is
prometheus_client's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

#: the label naming the replica of each sample
REPLICA_LABEL = "replica"
#: the ``replica`` label of the ingress's own samples
INGRESS = "ingress"


class IngressMetrics:
    """The ingress's own counters, in a registry of its own: ``errors`` (the refusals it answers
    itself, by status and code, named as the servers' ``precache_errors_total``) and
    ``replicas_reporting`` (replicas whose metrics the last scrape merged)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.errors = Counter(
            "precache_errors",
            "Error responses by HTTP status and error code",
            ["status", "code"],
            registry=self.registry,
        )
        self.replicas_reporting = Gauge(
            "precache_cluster_replicas_reporting",
            "Replicas whose metrics this scrape holds",
            registry=self.registry,
        )

    def error(self, status: int, code: str) -> None:
        """Count one refusal answered by the ingress."""
        self.errors.labels(str(status), code).inc()

    def text(self) -> str:
        """The ingress's metrics in the text format."""
        return generate_latest(self.registry).decode()


class _Merged:
    """A prometheus_client collector over already-built metric families."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self):
        yield from self.families


def merge_metrics(texts: Mapping[str, str]) -> bytes:
    """One exposition (Prometheus text format 0.0.4) of ``texts`` (source name -> its metrics in
    the text format): each sample gets ``replica="<source name>"``, and the samples of one metric
    family from every source are written together under one HELP and TYPE (the first source's).

    Raises:
        ValueError: a text is not in the Prometheus text format, or two sources give one family
            different types.
    """
    families: dict[str, Metric] = {}
    for source, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
            elif merged.type != family.type:
                raise ValueError(
                    f"metric {family.name}: type {family.type} from {source}, {merged.type} before"
                )
            merged.samples.extend(
                s._replace(labels={**s.labels, REPLICA_LABEL: source}) for s in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(families.values()))
    return generate_latest(registry)
