"""Attention over the block pool: the batch interface, the backend registry and the torch reference."""

from precache.cache.attention.base import (
    BACKENDS,
    AttentionBackend,
    BatchMetadata,
    KVRead,
    RowAttention,
    get_backend,
    register_backend,
)
from precache.cache.attention.segments import DECODE_MAX, Segment, attend
from precache.cache.attention.torch_backend import TorchBackend

__all__ = [
    "BACKENDS",
    "DECODE_MAX",
    "AttentionBackend",
    "BatchMetadata",
    "KVRead",
    "RowAttention",
    "Segment",
    "TorchBackend",
    "attend",
    "get_backend",
    "register_backend",
]
