"""Prometheus metrics of the server, in a registry of its own (several servers may share a process,
as in the tests). Updated from the scheduler thread; prometheus_client is thread-safe."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """TTFT and latency histograms (seconds, by model name), requests per batched forward, token
    counters, the cached-token ratio (cached prompt tokens / prompt tokens since start), error
    responses by status and code (``precache_errors_total``), gauges of cache bytes, sessions,
    running, waiting and held requests, and the connections and requests refused or cut for slow
    or stalled clients by reason (``precache_refused_total``: ``max_connections``,
    ``header_timeout``, ``body_timeout``, ``max_requests_in_flight``, ``stream_stalled``,
    ``draining``), the streams held for a client that stopped reading
    (``precache_streams_held_total``), the host swap space (``precache_swap_space_bytes`` by
    state: capacity, used; ``precache_swap_drops_total``: swapped-out sessions whose host copies
    were dropped; ``precache_swap_rebuilt_tokens_total``: tokens prefilled again to rebuild them),
    and prometheus_client's process metrics
    (``process_resident_memory_bytes``, CPU seconds, open file descriptors; on Linux)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds (Linux)
        self.ttft = Histogram(
            "precache_time_to_first_token_seconds",
            "Arrival to first token",
            ["model"],
            registry=r,
            buckets=_TIME_BUCKETS,
        )
        self.latency = Histogram(
            "precache_request_latency_seconds",
            "Arrival to last token",
            ["model"],
            registry=r,
            buckets=_TIME_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "precache_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "precache_cached_prompt_tokens", "Prompt tokens read from the shared cache", registry=r
        )
        self.generation_tokens = Counter("precache_generation_tokens", "Tokens generated", registry=r)
        self.batch_requests = Histogram(
            "precache_batch_requests",
            "Requests per batched forward",
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.requests = Counter("precache_requests", "Requests by outcome", ["outcome"], registry=r)
        self.cached_ratio = Gauge(
            "precache_cached_token_ratio", "Cached prompt tokens / prompt tokens since start", registry=r
        )
        self.cache_bytes = Gauge("precache_kv_cache_bytes", "Bytes held by all sessions' caches", registry=r)
        self.pool_bytes = Gauge(
            "precache_kv_pool_bytes",
            "KV block pool bytes by state (Engine.cache_usage: total, allocated, used, shared, cached, free)",
            ["state"],
            registry=r,
        )
        self.sessions = Gauge("precache_sessions", "Cached trajectories", registry=r)
        self.running = Gauge("precache_running_requests", "Requests in the batch", registry=r)
        self.waiting = Gauge("precache_waiting_requests", "Requests waiting for admission", registry=r)
        self.errors = Counter(
            "precache_errors",
            "Error responses by HTTP status and OpenAI error code (errors inside a stream included)",
            ["status", "code"],
            registry=r,
        )
        self.refused = Counter(
            "precache_refused",
            "Connections and requests refused or cut for slow or stalled clients, or while draining, by reason",
            ["reason"],
            registry=r,
        )
        self.held = Gauge(
            "precache_held_requests", "Requests held out of the batch for a slow reader", registry=r
        )
        self.streams_held = Counter(
            "precache_streams_held", "Times a request was held for a client that stopped reading", registry=r
        )
        self.swap_bytes = Gauge(
            "precache_swap_space_bytes",
            "Host swap space bytes by state (Engine.swap_usage: capacity, used)",
            ["state"],
            registry=r,
        )
        self.swap_drops = Counter(
            "precache_swap_drops",
            "Swapped-out sessions whose host copies were dropped past the swap space (rebuilt on return)",
            registry=r,
        )
        self.swap_rebuilt_tokens = Counter(
            "precache_swap_rebuilt_tokens", "Tokens prefilled again to rebuild dropped caches", registry=r
        )
        self._prompt = self._cached = 0
        self._drops = self._rebuilt = 0

    def error(self, status: int, code: str | None) -> None:
        """Count one error response (``status``: HTTP status; ``code``: the OpenAI error code)."""
        self.errors.labels(str(status), code or "none").inc()

    def finished(self, model: str, latency_s: float, prompt: int, cached: int, generated: int, outcome: str):
        """Record a finished request (token counts in tokens)."""
        self.latency.labels(model).observe(latency_s)
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)
        self.requests.labels(outcome).inc()
        self._prompt, self._cached = self._prompt + prompt, self._cached + cached
        self.cached_ratio.set(self._cached / self._prompt if self._prompt else 0.0)

    def pool_usage(self, usage: dict[str, int]) -> None:
        """Export :meth:`Engine.cache_usage` (bytes by state)."""
        for state, n in usage.items():
            self.pool_bytes.labels(state).set(n)

    def swap_usage(self, usage: dict[str, int]) -> None:
        """Export :meth:`Engine.swap_usage` (bytes; the engine's life counts advance the counters)."""
        for state in ("capacity", "used"):
            self.swap_bytes.labels(state).set(usage[state])
        self.swap_drops.inc(usage["drops"] - self._drops)
        self.swap_rebuilt_tokens.inc(usage["rebuilt_tokens"] - self._rebuilt)
        self._drops, self._rebuilt = usage["drops"], usage["rebuilt_tokens"]

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
