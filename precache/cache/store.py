"""Growable per-layer cache storage: :class:`KVStore` (keys after RoPE, values) and
:class:`LRStore` (an agent's rank-r down-projections ``h A^k``, ``h A^v``).

Rules (checked by :func:`precache.cache.integrity.check`): writes land at explicit trajectory
positions; ``length`` moves only through :meth:`commit` / :meth:`truncate`, after every layer of a
forward has written, so a view never reads a half-written token. Capacity doubles on demand, so a
decode step costs one slice write, not a re-allocation of the whole cache.
"""

from __future__ import annotations

import torch

_MIN_CAPACITY = 256


class _Growable:
    """Shared bookkeeping: a list of per-layer tensors ``[cap, *entry_shape]`` plus a length."""

    def __init__(self, num_layers: int, entry_shapes: list[tuple[int, ...]], dtype, device, offset: int = 0):
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.entry_shapes = entry_shapes
        self.offset = offset  # trajectory position of the first slot
        self.length = offset  # trajectory position one past the last committed token
        self.capacity = 0
        self.buffers: list[list[torch.Tensor]] = [[] for _ in entry_shapes]

    def reserve(self, end: int) -> None:
        """Make room up to trajectory position ``end``, keeping what is stored."""
        n = end - self.offset
        if n <= self.capacity:
            return
        cap = max(_MIN_CAPACITY, self.capacity * 2, n)
        for shape, bufs in zip(self.entry_shapes, self.buffers, strict=True):
            kept = self.length - self.offset
            for layer in range(self.num_layers):
                new = torch.zeros((cap, *shape), dtype=self.dtype, device=self.device)
                if self.capacity:
                    new[:kept] = bufs[layer][:kept]
                    bufs[layer] = new
                else:
                    bufs.append(new)
        self.capacity = cap

    def commit(self, length: int) -> None:
        """Declare tokens ``[0, length)`` written at every layer."""
        self.length = length

    def truncate(self, length: int) -> None:
        """Forget tokens from ``length`` on (divergence, DESIGN.md fact 6)."""
        self.length = max(self.offset, min(self.length, length))

    def nbytes(self) -> int:
        """Bytes held by the committed tokens (not the spare capacity)."""
        per_token = sum(int(torch.Size(s).numel()) for s in self.entry_shapes)
        return (self.length - self.offset) * per_token * self.num_layers * torch.finfo(self.dtype).bits // 8


class KVStore(_Growable):
    """Keys (after RoPE) and values ``[n_tokens, n_kv_heads, head_dim]`` per layer.

    Holds a shared base cache, or an agent's full KV cache (NonShared, FullShared).
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device=None, offset: int = 0
    ):
        super().__init__(
            num_layers, [(num_kv_heads, head_dim), (num_kv_heads, head_dim)], dtype, device, offset
        )

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[T, n_kv_heads, head_dim]`` at positions ``[start, start + T)``."""
        self.reserve(start + k.shape[0])
        i = start - self.offset
        self.buffers[0][layer][i : i + k.shape[0]] = k
        self.buffers[1][layer][i : i + v.shape[0]] = v

    def kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of keys and values at positions ``[start, end)``: ``[end - start, n_kv_heads, head_dim]``."""
        self.reserve(self.offset + 1)  # allocates on first use, so empty ranges read as empty tensors
        i, j = start - self.offset, end - self.offset
        return self.buffers[0][layer][i:j], self.buffers[1][layer][i:j]


class LRStore(_Growable):
    """An agent's LR cache: ``Lk = h A^k`` ``[n, r_k]`` and ``Lv = h A^v`` ``[n, r_v]`` per layer.

    A side the adapter does not adapt has rank 0 and costs nothing (DESIGN.md, Notation).
    """

    def __init__(self, num_layers: int, rank_k: int, rank_v: int, dtype, device=None):
        super().__init__(num_layers, [(rank_k,), (rank_v,)], dtype, device)
        self.rank_k, self.rank_v = rank_k, rank_v

    def write(self, layer: int, start: int, lk: torch.Tensor | None, lv: torch.Tensor | None) -> None:
        """Store ``lk`` ``[T, r_k]`` and ``lv`` ``[T, r_v]`` (None for an unadapted side) from ``start``."""
        n = (lk if lk is not None else lv).shape[0]
        self.reserve(start + n)
        if lk is not None:
            self.buffers[0][layer][start : start + n] = lk
        if lv is not None:
            self.buffers[1][layer][start : start + n] = lv

    def lr(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``Lk`` ``[end - start, r_k]`` and ``Lv`` ``[end - start, r_v]``."""
        self.reserve(self.offset + 1)  # allocates on first use, so empty ranges read as empty tensors
        i, j = start - self.offset, end - self.offset
        return self.buffers[0][layer][i:j], self.buffers[1][layer][i:j]
