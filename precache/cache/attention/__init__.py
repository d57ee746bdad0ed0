"""Attention over the block pool: the batch interface, the backend registry, the torch reference and
the fused Triton kernel (``triton``, optional: imported when that backend is built)."""

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
from precache.cache.attention.triton_backend import TritonBackend, default_backend, triton_available

__all__ = [
    "BACKENDS",
    "DECODE_MAX",
    "AttentionBackend",
    "BatchMetadata",
    "KVRead",
    "RowAttention",
    "Segment",
    "TorchBackend",
    "TritonBackend",
    "attend",
    "default_backend",
    "get_backend",
    "register_backend",
    "triton_available",
]
