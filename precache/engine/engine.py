"""The engine: one base model, its role adapters, one sharing method, and sessions over it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from precache.cache.pool import DEFAULT_BLOCK_SIZE
from precache.engine.session import Session
from precache.errors import AdapterError
from precache.lora.adapter import LoRAAdapter, load_adapter
from precache.methods import make_method

logger = logging.getLogger(__name__)


class Engine:
    """Multi-LoRA inference over shared trajectories.

    ``Engine(model, adapters={"plan": DIR, ...}, method="prelrshared")``: ``model`` from
    :func:`precache.load_model` (None: the embedded default), adapters as PEFT folders (or loaded
    :class:`LoRAAdapter` s) by agent name, ``method`` one of :data:`precache.methods.METHODS`.
    Every trajectory's caches live in one block pool (``self.pool``) of ``kv_cache_bytes`` bytes
    (default: room for ``n_agents + 2`` caches at the context length), in blocks of
    ``block_size`` tokens, shared by forks and by trajectories with a common token prefix.

    Raises:
        UnknownMethodError: ``method`` does not exist.
        CacheCapacityError: ``kv_cache_bytes`` holds no block.
        AdapterError: an adapter folder is missing, malformed, or does not fit the model.
    """

    def __init__(
        self,
        model=None,
        adapters: dict[str, str | os.PathLike | LoRAAdapter] | None = None,
        method: str = "prelrshared",
        kv_cache_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ):
        from precache.methods import METHODS
        from precache.models import load_model

        if method.lower().replace("_", "-") not in (*METHODS, "rebaseshared"):
            make_method(method, None, {})  # raises UnknownMethodError before any loading
        self.model = model if model is not None else load_model()
        self.tokenizer = self.model.tokenizer
        self.adapters: dict[str, LoRAAdapter] = {}
        for name, src in (adapters or {}).items():
            if not isinstance(name, str) or not name:
                raise AdapterError(f"adapter names must be non-empty strings, got {name!r}")
            adapter = (
                src if isinstance(src, LoRAAdapter) else load_adapter(Path(src), self.model.config, name)
            )
            self.adapters[name] = adapter.to(self.model.dtype, self.model.device)
        self.method = make_method(
            method, self.model, self.adapters, kv_cache_bytes=kv_cache_bytes, block_size=block_size
        )
        self.pool = self.method.pool
        self.eos_token_ids = self._eos_ids()

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (
            getattr(self.model.hf_config, "eos_token_id", None),
            getattr(self.tokenizer, "eos_token_id", None),
        ):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list | tuple):
                ids.update(int(i) for i in src)
        return frozenset(ids)

    def cache_usage(self) -> dict[str, int]:
        """KV-cache memory in bytes: ``total`` (the pool), ``allocated`` (blocks held by some
        trajectory), ``used`` (their positions that hold a committed token), ``shared`` (blocks held
        by several trajectories or forks, once), ``cached`` (unheld blocks kept for prefix reuse),
        ``free``. ``allocated + cached + free == total``."""
        return self.pool.usage()

    @property
    def method_name(self) -> str:
        return self.method.name

    @property
    def max_context(self) -> int:
        """Context length in tokens."""
        return self.model.max_context

    def session(self) -> Session:
        """A new, empty trajectory with its own caches."""
        return Session(self)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (requires a tokenizer)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: append token ids instead of text")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def decode_piece(self, token_ids: list[int]) -> str:
        """Text the last token of ``token_ids`` adds (context of a few tokens for multi-byte pieces)."""
        tail = token_ids[-6:]
        return self.decode(tail)[len(self.decode(tail[:-1])) :]
