"""Sharing methods, one module each, behind :class:`~precache.methods.base.SharingMethod`."""

from __future__ import annotations

from precache.errors import UnknownMethodError
from precache.methods.base import CacheState, SharingMethod
from precache.methods.baseshared import BaseShared
from precache.methods.cacheblend import CacheBlend
from precache.methods.droidspeak import DroidSpeak
from precache.methods.fullshared import FullShared
from precache.methods.nonshared import NonShared
from precache.methods.prelrshared import PreLRShared
from precache.methods.rebaseshared import ReBaseShared
from precache.methods.relaycaching import RelayCaching

METHODS = (
    "nonshared",
    "fullshared",
    "baseshared",
    "prelrshared",
    "rebaseshared-lp",
    "rebaseshared-db",
    "cacheblend",
    "droidspeak",
    "relaycaching",
)
#: the selective-recomputation baselines (DESIGN.md): a shared full cache, partly recomputed per turn
SELECTIVE_METHODS = ("cacheblend", "droidspeak", "relaycaching")


def make_method(name: str, model, adapters, **pool_options) -> SharingMethod:
    """Build the sharing method called ``name`` (one of :data:`METHODS`) with its block pool
    (``pool_options``: ``kv_cache_bytes``, ``block_size``; see :class:`SharingMethod`).

    Raises:
        UnknownMethodError: ``name`` is not a method.
    """
    key = name.lower().replace("_", "-")
    if key == "rebaseshared":
        key = "rebaseshared-lp"
    simple = {
        "nonshared": NonShared,
        "fullshared": FullShared,
        "baseshared": BaseShared,
        "prelrshared": PreLRShared,
        "cacheblend": CacheBlend,
        "droidspeak": DroidSpeak,
        "relaycaching": RelayCaching,
    }
    if key in simple:
        return simple[key](model, adapters, **pool_options)
    if key.startswith("rebaseshared-"):
        schedule = key.split("-", 1)[1]
        if schedule in ("lp", "db"):
            return ReBaseShared(model, adapters, schedule=schedule, **pool_options)
    raise UnknownMethodError(f"unknown sharing method '{name}' (methods: {', '.join(METHODS)})")


__all__ = ["METHODS", "SELECTIVE_METHODS", "CacheState", "SharingMethod", "make_method"]
