"""The server's frozen configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """How the server batches and caches.

    ``model_name``: the id of the base model in the API (requests for it run without adapter);
    ``max_cache_bytes``: budget over all sessions' caches in bytes (None: unbounded); idle sessions
    are evicted least recently used first. ``max_running``: requests in the batch at once (the
    rest wait). ``max_step_tokens``: prefill tokens per forward (chunked prefill; decode rows are
    always added). ``min_fork_tokens``: shortest shared prefix worth copying into a new session
    (see :class:`~precache.server.sessions.SessionPool`).
    """

    model_name: str = "base"
    max_cache_bytes: int | None = 2 * 1024**3
    max_running: int = 64
    max_step_tokens: int = 512
    min_fork_tokens: int = 32

    def __post_init__(self):
        if self.max_running < 1 or self.max_step_tokens < 1 or self.min_fork_tokens < 0:
            raise ValueError(f"invalid server configuration: {self}")
        if self.max_cache_bytes is not None and self.max_cache_bytes < 0:
            raise ValueError(f"max_cache_bytes must be >= 0, got {self.max_cache_bytes}")
