"""Swap preemption: a trajectory's cache blocks copied out of the pool to host memory and back.

The scheduler preempts a running request by swapping its session's caches out (vLLM's swap
preemption): every block its stores hold is copied to host memory once and released, so the pool
gets back every block the trajectory held alone. Swapping in allocates fresh blocks, copies the
contents back and puts the new ids into the same :class:`~precache.cache.pool.PagedStore` objects
(in place: row plans and LR views that point at a store stay valid), so the request resumes on
caches equal bit for bit to the ones it left, and its greedy tokens are those of an unpreempted
run.

Rules:
- a block held twice by the trajectory (a selective method's turn view forks the shared cache) is
  copied once and comes back as one block held twice;
- a block the trajectory shares with another one (a fork, a reused prefix) is copied too and our
  reference released: the other holder keeps it, and it comes back as our own copy;
- prefix hashes stay where they are (a released published block is cached for reuse by others); a
  swapped-in block is not published again until its trajectory publishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from precache.cache.pool import KVPool, PagedStore
from precache.errors import OutOfBlocksError


@dataclass
class SwappedBlocks:
    """Host copies of the blocks of ``stores``: ``k``, ``v`` ``[n_layers, n_blocks * block_size,
    n_kv_heads, head_dim]``, ``lr`` ``[n_layers, n_blocks * block_size, R]``; ``tables[i]`` holds
    store ``i``'s table as indices into those copies."""

    stores: list[PagedStore]
    tables: list[list[int]]
    k: torch.Tensor
    v: torch.Tensor
    lr: torch.Tensor

    @property
    def num_blocks(self) -> int:
        """Blocks :func:`swap_in` allocates."""
        return max((i for t in self.tables for i in t), default=-1) + 1

    @property
    def nbytes(self) -> int:
        """Host bytes the copies take."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.lr))


def _unique(stores: list[PagedStore]) -> list[PagedStore]:
    return list({id(s): s for s in stores}.values())


def _rows(pool: KVPool, blocks: list[int]) -> torch.Tensor:
    bs = pool.block_size
    idx = torch.tensor(blocks, dtype=torch.long).unsqueeze(1) * bs + torch.arange(bs)
    return idx.reshape(-1).to(pool.k.device)


def swap_out(pool: KVPool, stores: list[PagedStore]) -> SwappedBlocks:
    """Copy every block of ``stores`` to host memory and release the stores' references (their
    tables are emptied in place; their lengths are kept). Returns what :func:`swap_in` restores."""
    stores = _unique(stores)
    order: dict[int, int] = {}  # pool block -> index in the host copy
    tables = [[order.setdefault(b, len(order)) for b in s.blocks] for s in stores]
    rows = _rows(pool, list(order))
    host = torch.device("cpu")
    k, v, lr = (t[:, rows].to(host, copy=True) for t in (pool.k, pool.v, pool.lr))
    with pool.allocator.lock:
        for store in stores:
            for block in store.blocks:
                pool.allocator.release(block)
            store.blocks.clear()
    return SwappedBlocks(stores, tables, k, v, lr)


def swap_in(pool: KVPool, swapped: SwappedBlocks) -> None:
    """Allocate ``swapped.num_blocks`` fresh blocks, copy the host copies into them and give each
    store its table back (in place).

    Raises:
        OutOfBlocksError: the pool cannot hand out that many blocks now (nothing is changed).
    """
    alloc, n = pool.allocator, swapped.num_blocks
    with alloc.lock:
        if n > alloc.num_available:
            raise OutOfBlocksError(f"swapping in needs {n} KV-cache blocks, {alloc.num_available} available")
        fresh: list[int] = []
        for _ in range(n):
            fresh.append(alloc.allocate(after=fresh[-1] if fresh else None))
        seen: set[int] = set()
        for store, table in zip(swapped.stores, swapped.tables, strict=True):
            for i in table:
                if i in seen:  # a block this trajectory held twice: one more reference
                    alloc.hold(fresh[i])
                seen.add(i)
            store.blocks.extend(fresh[i] for i in table)
    if n:
        rows = _rows(pool, fresh)
        pool.k[:, rows] = swapped.k.to(pool.k.device)
        pool.v[:, rows] = swapped.v.to(pool.v.device)
        pool.lr[:, rows] = swapped.lr.to(pool.lr.device)
