"""The engine: one base model, its role adapters, one sharing method, and sessions over it."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar, Unpack

from precache.cache.attention import default_backend, get_backend
from precache.cache.plan import run_plans
from precache.compute import on_compute
from precache.config import SamplingOptions
from precache.engine.concurrency import run_concurrently
from precache.engine.config import EngineConfig, EngineOptions, spare_lr_slots
from precache.engine.decoding import eos_token_ids
from precache.engine.detokenize import token_bytes
from precache.engine.outputs import Turn
from precache.engine.request import Request
from precache.engine.rows import Batch
from precache.engine.scheduler import Scheduler
from precache.engine.session import Session
from precache.engine.swap_space import SwapSpace
from precache.engine.warmup import compile_layouts
from precache.errors import AdapterBusyError, AdapterError, AdapterLimitError, UnknownAdapterError
from precache.lora.adapter import LoRAAdapter, load_adapter
from precache.methods import build_pool, make_method
from precache.models import load_model

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# HF fast tokenizers refuse concurrent use from two threads ("Already borrowed"), and engines may
# share one tokenizer: every tokenizer call in the process goes through this lock (microseconds).
TOKENIZER_LOCK = threading.RLock()


class Engine:
    """Multi-LoRA inference over shared trajectories.

    ``Engine(model, adapters={"plan": DIR, ...}, method="prelrshared", kv_cache_bytes=N)``: ``model``
    from :func:`precache.load_model` (None: the embedded default), adapters as PEFT folders (or
    loaded :class:`LoRAAdapter` s) by agent name, then the configuration, fixed once built
    (``self.config``): the fields of :class:`~precache.engine.config.EngineConfig` as keyword
    arguments (each documented there), or ``config=`` a whole one (keyword arguments then replace
    its fields). Every trajectory's caches live in one block pool (``self.pool``).

    Raises:
        UnknownMethodError: ``method`` does not exist.
        ValueError: no attention backend has the name ``attention_backend``.
        ImportError: ``attention_backend="triton"`` without triton installed.
        CacheCapacityError: ``kv_cache_bytes`` holds no block.
        AdapterError: an adapter folder is missing, malformed, or does not fit the model.
        ValueError: ``max_adapters`` / ``max_lora_rank`` below the adapters given, an unknown
            ``kv_cache_dtype``, or a field :class:`EngineConfig` refuses.
        TypeError: a keyword argument that is no :class:`EngineConfig` field.
    """

    def __init__(
        self,
        model=None,
        adapters: dict[str, str | os.PathLike | LoRAAdapter] | None = None,
        *,
        config: EngineConfig | None = None,
        **options: Unpack[EngineOptions],
    ):
        # checked before any loading (an unknown method raises UnknownMethodError)
        self.config = config = replace(config or EngineConfig(), **options)
        self.model = model if model is not None else load_model()
        self.tokenizer = self.model.tokenizer
        self.adapters: dict[str, LoRAAdapter] = {}
        for name, src in (adapters or {}).items():
            if not isinstance(name, str) or not name:
                raise AdapterError(f"adapter names must be non-empty strings, got {name!r}")
            self.adapters[name] = self._load_adapter(name, src).to(self.model.dtype, self.model.device)
        spare, self.max_lora_rank = spare_lr_slots(config, [a.rank for a in self.adapters.values()])
        self.pool = build_pool(
            config.method,
            self.model,
            self.adapters,
            kv_cache_bytes=config.kv_cache_bytes,
            block_size=config.block_size,
            spare_lr_slots=spare,
            spare_lr_rank=self.max_lora_rank,
            kv_cache_dtype=config.pool_dtype(self.model),
        )
        self.method = make_method(
            config.method, self.model, self.adapters, self.pool, prefix_caching=config.prefix_caching
        )
        self.attention = get_backend(config.attention_backend or default_backend(self.model.device))
        self.eos_token_ids = eos_token_ids(self.model)
        self.swap_space = SwapSpace(self.pool, config.host_swap_bytes())
        self.scheduler = Scheduler(
            self._forward, config.scheduler, pool=self.pool, runner=on_compute, swap_space=self.swap_space
        )

    def _load_adapter(self, name: str, src: str | os.PathLike | LoRAAdapter) -> LoRAAdapter:
        return src if isinstance(src, LoRAAdapter) else load_adapter(Path(src), self.model.config, name)

    # -- adapters at run time ---------------------------------------------------------------------
    def add_adapter(self, name: str, src: str | os.PathLike | LoRAAdapter) -> LoRAAdapter:
        """Load a PEFT adapter folder (or take a loaded :class:`LoRAAdapter`) as agent ``name``, between
        two steps; requests may use it from the next step on. Every existing trajectory gets its
        caches for it at its next turn, as the sharing method defines (DESIGN.md, "Adapters loaded at
        run time"). Split methods (BaseShared, PreLRShared, ReBaseShared) need a free LR-cache slot:
        create the engine with ``max_adapters`` above the adapters given, and ``max_lora_rank`` (default
        the largest of 16 and the given ranks) at least the new adapter's rank.

        Raises:
            AdapterLimitError: ``max_adapters`` adapters are loaded, or the rank is above ``max_lora_rank``.
            AdapterError: a bad name (empty, taken), a missing or malformed folder, an adapter that
                does not fit the model or method.
            CacheCapacityError: no free LR-cache slot.
        """
        if not isinstance(name, str) or not name.strip():
            raise AdapterError(f"adapter names must be non-empty strings, got {name!r}")
        adapter = self._load_adapter(name, src)
        # bounds under every method (split methods also by their LR columns)
        bound = self.max_lora_rank if self.method.splits_kv else self.config.max_lora_rank
        if bound is not None and adapter.rank > bound:
            raise AdapterLimitError(f"adapter '{name}' has rank {adapter.rank}, above max_lora_rank={bound}")
        adapter = adapter.to(self.model.dtype, self.model.device)

        def add() -> None:  # between two steps: the checks and the change see the same adapters
            if name in self.adapters:
                raise AdapterError(f"adapter '{name}' is loaded already")
            limit = self.config.max_adapters
            if limit is not None and len(self.adapters) >= limit:
                raise AdapterLimitError(
                    f"cannot load adapter '{name}': {len(self.adapters)} adapters are loaded, "
                    f"max_adapters={limit}"
                )
            self.method.add_adapter(name, adapter)

        self.scheduler.exclusive(add)
        logger.info("adapter '%s' added (rank %d)", name, adapter.rank)
        return adapter

    def remove_adapter(self, name: str) -> None:
        """Unload agent ``name`` between two steps; its caches leave each trajectory at its next turn.

        Raises:
            UnknownAdapterError: ``name`` is not loaded.
            AdapterBusyError: a request of ``name`` is waiting or running (unload it once they end).
        """

        def remove() -> None:
            if name not in self.adapters:
                raise UnknownAdapterError(f"adapter '{name}' is not loaded")
            busy = self.scheduler.requests_of(name)
            if busy:
                raise AdapterBusyError(
                    f"adapter '{name}' is used by {busy} waiting or running request(s); unload it once they end"
                )
            self.method.remove_adapter(name)

        self.scheduler.exclusive(remove)
        logger.info("adapter '%s' removed", name)

    def cache_usage(self) -> dict[str, int]:
        """KV-cache memory in bytes: ``total`` (the pool), ``allocated`` (blocks held by some
        trajectory), ``used`` (their positions that hold a committed token), ``shared`` (blocks held
        by several trajectories or forks, once), ``cached`` (unheld blocks kept for prefix reuse),
        ``free``. ``allocated + cached + free == total``."""
        return self.pool.usage()

    def swap_usage(self) -> dict[str, int]:
        """Host swap space (:class:`~precache.engine.swap_space.SwapSpace`): ``capacity``, ``used``
        and ``peak`` in bytes, ``sessions`` swapped out now, and over the engine's life
        ``swap_outs``, ``drops`` (sessions whose host copies were dropped) and ``rebuilt_tokens``
        (tokens prefilled again to rebuild them)."""
        return self.swap_space.usage()

    # -- configuration and state, read-only to apps ----------------------------------------------
    def configure(self, **limits: Unpack[EngineOptions]) -> EngineConfig:
        """Change the scheduler's limits (``max_running``, ``max_step_tokens``) between two steps;
        return the engine's new :class:`EngineConfig` (a server applies its own limits to the engine
        it is given). Every other field is fixed once the engine is built.

        Raises:
            TypeError: a field other than the scheduler's limits.
            ValueError: a limit below 1.
        """
        config = self.config.with_limits(**limits)

        def apply() -> None:
            self.config, self.scheduler.config = config, config.scheduler

        self.scheduler.exclusive(apply)
        return config

    def set_idle_reclaim(self, reclaim: Callable[[int], int] | None) -> None:
        """Let the owner of idle sessions give blocks back first when a step is short: ``reclaim(n)``
        frees about ``n`` blocks (the server drops cached conversations) and returns the blocks it
        freed (:class:`~precache.engine.preemption.Preemption`). None: no such owner."""
        self.scheduler.preemption.reclaim = reclaim

    @property
    def num_waiting(self) -> int:
        """Requests waiting to start or, preempted, to resume (read between steps)."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests in the batch (read between steps)."""
        return len(self.scheduler.running)

    @property
    def has_work(self) -> bool:
        """Some request is queued, waiting or running: :meth:`step` has something to do."""
        return self.scheduler.has_work

    @property
    def method_name(self) -> str:
        return self.method.name

    @property
    def max_context(self) -> int:
        """Context length in tokens."""
        return self.model.max_context

    def session(self, cache_salt: str | None = None) -> Session:
        """A new, empty trajectory with its own caches; ``cache_salt`` names its tenant (None: the
        default one): it reuses cache blocks by token prefix only from trajectories of the same salt."""
        return Session(self, cache_salt=cache_salt)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (requires a tokenizer)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: append token ids instead of text")
        with TOKENIZER_LOCK:
            return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int], **options) -> str:
        """Text of ``token_ids``; ``options`` go to the tokenizer's ``decode`` (default:
        ``skip_special_tokens=False``). Without a tokenizer: the ids joined by spaces."""
        if self.tokenizer is None:
            return " ".join(map(str, token_ids))
        with TOKENIZER_LOCK:
            return self.tokenizer.decode(token_ids, **{"skip_special_tokens": False, **options})

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for, possibly part of a UTF-8 character
        (:func:`~precache.engine.detokenize.token_bytes`). Without a tokenizer: its id as text."""
        if self.tokenizer is None:
            return str(token_id).encode("ascii")
        with TOKENIZER_LOCK:
            return token_bytes(self.tokenizer, token_id)

    # -- batching: one scheduler, one forward per step -------------------------------------------
    def _forward(self, plans: list) -> list:
        return on_compute(lambda: run_plans(self.model, plans, self.attention))

    def compile_decode_step(self) -> None:
        """Compile the model's captured decode step for this engine's method and adapters now, not in
        the first requests' decode (a server calls it before it listens, ``bench trace`` before its
        warm-up): every layout, on throwaway trajectories (:func:`precache.engine.warmup.compile_layouts`).
        Seconds when the graphs are in the disk cache, minutes each when cold (docs/performance.md,
        "Compiled decode"). Nothing happens when the model has no captured step (``compile=False``,
        not a CPU)."""
        if getattr(self.model, "decode_graph", None) is not None:
            compile_layouts(self)

    def submit(self, request: Request) -> Request:
        """Queue ``request`` (any thread; :meth:`Session.submit` builds and validates one); it joins
        the batch at the next :meth:`step`."""
        self.scheduler.add(request)
        return request

    def step(self) -> Batch:
        """Run ONE batched forward over every running request (prefill chunks, decode rows,
        ReBaseShared's neutral rows, post-turn passes) after admitting waiting ones; return what ran.
        One thread steps at a time: a concurrent call waits for the running step, then runs its own."""
        return self.scheduler.step()

    def wait(self, request: Request, until: Callable[[], bool] | None = None) -> None:
        """Step until ``until()`` holds (default: ``request`` finished), or wait while another thread
        steps: every waiting thread's rows share the same forwards. Errors stay on the request
        (:meth:`Request.outcome`)."""
        self.scheduler.drive(until or (lambda: request.all_finished))

    def wait_all(self, requests: Sequence[Request]) -> list[Turn]:
        """Step until every request is over; return their turns in order.

        Raises:
            the first request's error (:meth:`Request.outcome`).
        """
        self.scheduler.drive(lambda: all(r.all_finished for r in requests))
        return [r.outcome() for r in requests]

    def cancel(self, request: Request) -> None:
        """Cancel ``request`` at the next step (any thread; see :meth:`Scheduler.cancel`)."""
        self.scheduler.cancel(request)

    def generate_batch(
        self, prompts: Sequence[str | list[int]], agent: str | None = None, **kwargs: Unpack[SamplingOptions]
    ) -> list[Turn]:
        """One turn of ``agent`` on a new session per prompt, all batched together (like
        ``vllm.LLM.generate``); keyword arguments are :class:`~precache.config.SamplingParams`
        fields. Returns the turns in the order of ``prompts``.

        Raises:
            UnknownAdapterError, EmptyRequestError, ContextLengthError, ValueError: a bad prompt or
            parameter (nothing runs).
        """
        sessions = [self.session() for _ in prompts]
        for session, prompt in zip(sessions, prompts, strict=True):
            session.append(prompt)
        params = [s.validate(agent, dict(kwargs)) for s in sessions]
        return self.wait_all(
            [self.submit(Request(s, agent, p)) for s, p in zip(sessions, params, strict=True)]
        )

    def run_concurrently(
        self, fn: Callable[[T], R], items: Iterable[T], concurrency: int = 1, desc: str | None = None
    ) -> list[R]:
        """``[fn(item) for item in items]`` on ``concurrency`` threads (results in input order, a
        progress bar when ``desc`` is given): N independent trajectories, e.g. agent episodes each on
        its own session of this engine, whose forwards are batched
        (:func:`~precache.engine.concurrency.run_concurrently`)."""
        return run_concurrently(fn, items, concurrency, desc)
