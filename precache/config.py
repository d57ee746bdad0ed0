"""Frozen configuration dataclasses shared by the engine, the CLI and the server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How a turn samples. ``temperature=0`` is greedy and deterministic.

    ``stop``: the turn ends right after the token that completes any of these strings (the string
    stays in the output). ``seed`` makes sampling with ``temperature > 0`` reproducible.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        from precache.errors import EmptyRequestError

        if self.max_new_tokens < 1:
            raise EmptyRequestError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
