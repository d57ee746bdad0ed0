"""What an engine is configured with, fixed once it is built: :class:`EngineConfig`.

``Engine(model, adapters, method="prelrshared", kv_cache_bytes=N, ...)`` builds one from its
keyword arguments (:class:`EngineOptions`), or takes one whole (``Engine(model, adapters,
config=EngineConfig(...))``). Only the scheduler's limits may change on a built engine
(:meth:`~precache.engine.engine.Engine.configure`, which returns a new config); everything else
(the sharing method, the pool, its dtype, the adapter slots, the swap space) is sized once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypedDict

import torch

from precache.cache.pool import DEFAULT_BLOCK_SIZE
from precache.engine.swap_space import check_swap_space_bytes, default_swap_space_bytes
from precache.methods import METHOD_REGISTRY
from precache.models.quant import resolve_kv_cache_dtype


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's limits. ``max_running``: requests in the batch at once (the rest wait; vLLM's
    ``max_num_seqs``); ``max_step_tokens``: prefill tokens per forward (chunked prefill; decode rows
    and post-turn passes are always added; None: every prefill whole, in one forward; vLLM's
    ``max_num_batched_tokens``).

    Raises:
        ValueError: a limit below 1.
    """

    max_running: int = 64
    max_step_tokens: int | None = None

    def __post_init__(self):
        if self.max_running < 1 or (self.max_step_tokens is not None and self.max_step_tokens < 1):
            raise ValueError(f"invalid scheduler configuration: {self}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine's configuration; every field is checked on construction.

    - ``method``: the sharing method's name (:data:`precache.methods.METHODS`).
    - ``kv_cache_bytes``: the block pool in bytes, allocated once; every trajectory's caches live
      in it (None: room for ``n_agents + 2`` caches at the context length). ``block_size``: tokens
      per block. ``prefix_caching``: trajectories with a common token prefix share its blocks.
    - ``kv_cache_dtype``: the pool's K/V and LR entries in another dtype than the model's
      (:func:`~precache.models.quant.resolve_kv_cache_dtype`; vLLM's ``kv_cache_dtype``; None: the
      model's ``kv_cache_dtype`` from :func:`precache.load_model`, else its dtype): ``"bfloat16"``
      halves an fp32 model's cache and what each decode step reads from it; entries are rounded
      once when written and widened to the model's dtype when read (docs/performance.md, "KV-cache dtype").
    - ``attention_backend``: the attention kernel, ``"torch"`` or ``"triton"`` (None: ``"triton"``
      on CUDA when triton is installed, else ``"torch"``).
    - ``max_adapters``: adapters loaded at once, counting those ``Engine.add_adapter`` adds later;
      ``max_lora_rank``: their rank, under every method. Split methods reserve LR-cache columns for
      the spare ones, ``max_lora_rank`` each (default: the largest of 16 and the given ranks).
      None: no bound, except that a split method then has no spare LR columns.
    - ``swap_space_bytes``: host memory for swapped-out caches, in bytes (None: a quarter of the
      machine's physical memory; vLLM's ``swap_space``).
    - ``max_running``, ``max_step_tokens``: the scheduler's limits (:class:`SchedulerConfig`).

    The model and the adapters are not configuration: they are the engine's first arguments.

    Raises:
        UnknownMethodError: ``method`` does not exist.
        ValueError: ``max_adapters`` / ``max_lora_rank`` not an integer >= 1 or None,
            ``swap_space_bytes`` not an integer >= 0 or None, a scheduler limit below 1.
    """

    method: str = "prelrshared"
    kv_cache_bytes: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_caching: bool = True
    kv_cache_dtype: str | torch.dtype | None = None
    attention_backend: str | None = None
    max_adapters: int | None = None
    max_lora_rank: int | None = None
    swap_space_bytes: int | None = None
    max_running: int = 64
    max_step_tokens: int | None = None

    def __post_init__(self):
        METHOD_REGISTRY.canonical(self.method)  # raises UnknownMethodError before any loading
        if self.swap_space_bytes is not None:
            check_swap_space_bytes(self.swap_space_bytes)
        for what in ("max_adapters", "max_lora_rank"):
            value = getattr(self, what)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{what} must be an integer >= 1 or None, got {value!r}")
        SchedulerConfig(self.max_running, self.max_step_tokens)  # raises on a limit below 1

    @property
    def scheduler(self) -> SchedulerConfig:
        """The scheduler's limits."""
        return SchedulerConfig(self.max_running, self.max_step_tokens)

    def pool_dtype(self, model) -> torch.dtype:
        """The block pool's dtype on ``model``: ``kv_cache_dtype``, or the model's default.

        Raises:
            ValueError: an unknown ``kv_cache_dtype``.
        """
        dtype = self.kv_cache_dtype if self.kv_cache_dtype is not None else model.kv_cache_dtype
        return resolve_kv_cache_dtype(dtype, model.dtype)

    def host_swap_bytes(self) -> int:
        """The swap space in bytes: ``swap_space_bytes``, or the default share of physical memory."""
        return default_swap_space_bytes() if self.swap_space_bytes is None else self.swap_space_bytes

    def with_limits(self, **limits) -> EngineConfig:
        """This config with new scheduler limits (``max_running``, ``max_step_tokens``).

        Raises:
            TypeError: another field (it is fixed once the engine is built).
            ValueError: a limit below 1.
        """
        fixed = sorted(set(limits) - set(SCHEDULER_LIMITS))
        if fixed:
            raise TypeError(
                f"{', '.join(fixed)} cannot change on a built engine (only {', '.join(SCHEDULER_LIMITS)})"
            )
        return replace(self, **limits)


class EngineOptions(TypedDict, total=False):
    """:class:`EngineConfig` as keyword arguments (``Engine(model, adapters, **options)``), named so
    that editors and type checkers see them. The same fields (a test holds them equal)."""

    method: str
    kv_cache_bytes: int | None
    block_size: int
    prefix_caching: bool
    kv_cache_dtype: str | torch.dtype | None
    attention_backend: str | None
    max_adapters: int | None
    max_lora_rank: int | None
    swap_space_bytes: int | None
    max_running: int
    max_step_tokens: int | None


#: ``max_lora_rank`` when not given: vLLM's default, or the largest rank of the adapters given
DEFAULT_MAX_LORA_RANK = 16
#: the fields :meth:`~precache.engine.engine.Engine.configure` may change on a built engine
SCHEDULER_LIMITS = ("max_running", "max_step_tokens")


def spare_lr_slots(config: EngineConfig, ranks: list[int]) -> tuple[int, int]:
    """LR-cache slots a split method reserves for adapters added later, and their rank, given the
    ``ranks`` of the adapters the engine starts with.

    Raises:
        ValueError: ``max_adapters`` below the adapters given, or ``max_lora_rank`` below their ranks.
    """
    if config.max_adapters is not None and config.max_adapters < len(ranks):
        raise ValueError(f"max_adapters={config.max_adapters} is below the {len(ranks)} adapters given")
    rank = config.max_lora_rank if config.max_lora_rank is not None else max([DEFAULT_MAX_LORA_RANK, *ranks])
    if ranks and max(ranks) > rank:
        raise ValueError(f"max_lora_rank={rank} is below the largest given adapter rank {max(ranks)}")
    return (0 if config.max_adapters is None else config.max_adapters - len(ranks)), rank
