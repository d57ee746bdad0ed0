"""Sharing methods, one module each, behind :class:`~precache.methods.base.SharingMethod` (the hooks a
method implements; :mod:`precache.methods.machinery` is what they share), and the registry that
builds them by name with the block pool built for them (:func:`build_pool`, :func:`make_method`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from precache.cache.pool import DEFAULT_BLOCK_SIZE, KVPool
from precache.errors import UnknownMethodError
from precache.methods.base import SharingMethod
from precache.methods.baseshared import BaseShared
from precache.methods.cacheblend import CacheBlend
from precache.methods.droidspeak import DroidSpeak
from precache.methods.fullshared import FullShared
from precache.methods.nonshared import NonShared
from precache.methods.prelrshared import PreLRShared
from precache.methods.rebaseownshared import ReBaseOwnShared
from precache.methods.rebaseshared import ReBaseShared
from precache.methods.relaycaching import RelayCaching
from precache.methods.sizing import check_splittable, pool_for
from precache.methods.state import CacheState
from precache.registry import Registry

#: the sharing methods by name (:func:`make_method` builds one): a class, or a class with options
#: (``functools.partial``), called ``(model, adapters, pool, **options) -> SharingMethod``;
#: ``rebaseshared`` is ``rebaseshared-lp``, ``rebaseownshared`` is ``rebaseownshared-lp``
METHOD_REGISTRY: Registry[Callable[..., SharingMethod]] = Registry(
    "sharing method", UnknownMethodError, noun="method"
)
METHOD_REGISTRY.register("nonshared", NonShared)
METHOD_REGISTRY.register("fullshared", FullShared)
METHOD_REGISTRY.register("baseshared", BaseShared)
METHOD_REGISTRY.register("prelrshared", PreLRShared)
METHOD_REGISTRY.register("rebaseshared-lp", partial(ReBaseShared, schedule="lp"), aliases=("rebaseshared",))
METHOD_REGISTRY.register("rebaseshared-db", partial(ReBaseShared, schedule="db"))
METHOD_REGISTRY.register(
    "rebaseownshared-lp", partial(ReBaseOwnShared, schedule="lp"), aliases=("rebaseownshared",)
)
METHOD_REGISTRY.register("rebaseownshared-db", partial(ReBaseOwnShared, schedule="db"))
METHOD_REGISTRY.register("cacheblend", CacheBlend)
METHOD_REGISTRY.register("droidspeak", DroidSpeak)
METHOD_REGISTRY.register("relaycaching", RelayCaching)

#: every method's name, in the order tables list them
METHODS = METHOD_REGISTRY.names
#: the selective-recomputation baselines (DESIGN.md): a shared full cache, partly recomputed per turn
SELECTIVE_METHODS = ("cacheblend", "droidspeak", "relaycaching")


def method_class(name: str) -> type[SharingMethod]:
    """The class of the sharing method called ``name`` (any spelling :data:`METHOD_REGISTRY` takes).

    Raises:
        UnknownMethodError: ``name`` is not a method (the message lists them).
    """
    factory = METHOD_REGISTRY[name]
    return factory.func if isinstance(factory, partial) else factory


def build_pool(
    name: str,
    model,
    adapters: dict,
    kv_cache_bytes: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    spare_lr_slots: int = 0,
    spare_lr_rank: int = 0,
    kv_cache_dtype: torch.dtype | None = None,
) -> KVPool:
    """The block pool for the method called ``name`` over ``adapters`` (agent name ->
    :class:`~precache.lora.adapter.LoRAAdapter`), allocated now: ``kv_cache_bytes`` bytes (None:
    room for ``len(adapters) + 2`` caches at the context length, capped on a GPU), blocks of
    ``block_size`` tokens, entries at ``kv_cache_dtype`` (None: the model's dtype); a method that
    splits K/V gets each adapter's LR columns and ``spare_lr_slots`` more of ``spare_lr_rank``
    (:func:`precache.methods.sizing.pool_for`).

    Raises:
        UnknownMethodError: ``name`` is not a method.
        AdapterError: an adapter the method cannot hold (a k_proj LoRA under a split method on a
            model with a per-head k-norm), refused before the pool is allocated.
        ValueError: a bad ``block_size``, ``kv_cache_bytes`` or spare count.
        CacheCapacityError: ``kv_cache_bytes`` holds no block.
    """
    cls = method_class(name)
    if cls.splits_kv:
        for agent, adapter in adapters.items():
            check_splittable(METHOD_REGISTRY.canonical(name), model.config, agent, adapter)
    return pool_for(
        cls.splits_kv,
        model,
        adapters,
        kv_cache_bytes,
        block_size,
        spare_lr_slots,
        spare_lr_rank,
        kv_cache_dtype,
    )


def make_method(name: str, model, adapters, pool: KVPool | None = None, **options) -> SharingMethod:
    """Build the sharing method called ``name`` (one of :data:`METHODS`, any case, ``_`` for ``-``,
    or ``rebaseshared`` for ``rebaseshared-lp``) over ``pool``, built for it by :func:`build_pool`
    (the engine builds it; None: one of :func:`build_pool`'s default size built here).
    ``options``: ``prefix_caching`` and the method's own (CacheBlend's ``rho``, ...).

    Raises:
        UnknownMethodError: ``name`` is not a method (the message lists them).
    """
    factory = METHOD_REGISTRY[name]
    if pool is None:
        pool = build_pool(name, model, adapters)
    return factory(model, adapters, pool, **options)


__all__ = [
    "METHODS",
    "METHOD_REGISTRY",
    "SELECTIVE_METHODS",
    "CacheState",
    "SharingMethod",
    "build_pool",
    "make_method",
    "method_class",
]
