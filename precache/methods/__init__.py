"""Sharing methods, one module each, behind :class:`~precache.methods.base.SharingMethod`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from precache.errors import UnknownMethodError
from precache.methods.base import CacheState, SharingMethod
from precache.methods.baseshared import BaseShared
from precache.methods.cacheblend import CacheBlend
from precache.methods.droidspeak import DroidSpeak
from precache.methods.fullshared import FullShared
from precache.methods.nonshared import NonShared
from precache.methods.prelrshared import PreLRShared
from precache.methods.rebaseownshared import ReBaseOwnShared
from precache.methods.rebaseshared import ReBaseShared
from precache.methods.relaycaching import RelayCaching
from precache.registry import Registry

#: the sharing methods by name (:func:`make_method` builds one): a factory
#: ``(model, adapters, **pool_options) -> SharingMethod`` each; ``rebaseshared`` is ``rebaseshared-lp``,
#: ``rebaseownshared`` is ``rebaseownshared-lp``
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


def make_method(name: str, model, adapters, **pool_options) -> SharingMethod:
    """Build the sharing method called ``name`` (one of :data:`METHODS`, any case, ``_`` for ``-``,
    or ``rebaseshared`` for ``rebaseshared-lp``) with its block pool (``pool_options``:
    ``kv_cache_bytes``, ``block_size``; see :class:`SharingMethod`).

    Raises:
        UnknownMethodError: ``name`` is not a method (the message lists them).
    """
    return METHOD_REGISTRY[name](model, adapters, **pool_options)


__all__ = ["METHODS", "METHOD_REGISTRY", "SELECTIVE_METHODS", "CacheState", "SharingMethod", "make_method"]
