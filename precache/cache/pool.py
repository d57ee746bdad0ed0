"""The KV block pool: every cache of every trajectory lives in blocks allocated up front.

A block holds ``block_size`` token positions at every layer: base or full keys and values
(``[block_size, n_kv_heads, head_dim]`` each) and, for methods that split K/V into base + LR, the LR
rows of every agent side by side (``[block_size, R]``, ``R`` = the sum of the agents' ``r_k + r_v``;
DESIGN.md, Notation). A trajectory's cache is a :class:`PagedStore`: a block table plus a committed
length; an agent's LR cache is an :class:`LRView` of its base store's blocks with its own length.

Rules (mini-sglang's KV-cache contract, adapted):
- writes land at explicit positions, after :meth:`PagedStore.prepare_write` made the blocks
  exclusive (a block held by several tables is copied first: copy-on-write);
- ``length`` moves only through ``commit`` / ``truncate``, after every layer of a forward wrote,
  so a view never reads a half-written token;
- a fork holds the same blocks (O(1) memory); freeing a store releases its blocks, which stay
  cached for prefix reuse when they were registered (:mod:`precache.cache.blocks`).
"""

from __future__ import annotations

import math
import weakref

import torch

from precache.cache.blocks import BlockAllocator
from precache.errors import CacheCapacityError
from precache.models.step_attention import VALUE_PAD

DEFAULT_BLOCK_SIZE = 16


class KVPool:
    """Pre-allocated cache memory: ``k``, ``v`` ``[n_layers, num_blocks * block_size, n_kv_heads,
    head_dim]`` and ``lr`` ``[n_layers, num_blocks * block_size, R]``.

    ``lr_ranks[agent] = (r_k, r_v)`` lays out each agent's LR columns (empty for methods without LR
    caches); ``spare_lr_slots`` more slots of ``spare_lr_rank`` key and value columns each are kept
    free for adapters added later (:meth:`assign_lr`), like vLLM's ``max_loras`` / ``max_lora_rank``:
    the columns are part of every block, so the room is reserved up front. ``kv_cache_bytes`` is the budget in bytes; the pool holds
    ``kv_cache_bytes // block_bytes`` blocks, reserved now, so the cache can never outgrow the budget
    (on CPU the pages become resident as blocks are first written; on CUDA the memory is taken now).
    A view only ever reads positions some forward wrote.

    Raises:
        CacheCapacityError: the budget holds no block at all.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        lr_ranks: dict[str, tuple[int, int]],
        kv_cache_bytes: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device=None,
        spare_lr_slots: int = 0,
        spare_lr_rank: int = 0,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_layers, self.block_size, self.dtype, self.device = num_layers, block_size, dtype, device
        self.lr_cols: dict[str, tuple[slice, slice]] = {}
        col = 0
        for agent, (rk, rv) in lr_ranks.items():
            self.lr_cols[agent] = (slice(col, col + rk), slice(col + rk, col + rk + rv))
            col += rk + rv
        # free column ranges (first column, width), smallest first: spare slots and released agents'
        self.free_lr: list[tuple[int, int]] = []
        for _ in range(spare_lr_slots if spare_lr_rank > 0 else 0):
            self.free_lr.append((col, 2 * spare_lr_rank))
            col += 2 * spare_lr_rank
        self.lr_width = col
        self.kv_width = num_kv_heads * head_dim
        itemsize = torch.finfo(dtype).bits // 8
        self.token_bytes = num_layers * (2 * self.kv_width + self.lr_width) * itemsize  # one position
        self.block_bytes = block_size * self.token_bytes
        num_blocks = int(kv_cache_bytes) // self.block_bytes
        if num_blocks < 1:
            raise CacheCapacityError(
                f"kv_cache_bytes={kv_cache_bytes} holds no block (one block is {self.block_bytes} bytes)"
            )
        n = num_blocks * block_size
        # on a CPU each tensor sits one unused layer into its storage (never touched, so never
        # resident): views of it then never start at offset 0 or 1, which the compiled decode step
        # would otherwise compile another graph for (precache.models.step_attention's window)
        pad = 1 if device is None or torch.device(device).type == "cpu" else 0
        self.k = torch.empty(pad + num_layers, n, num_kv_heads, head_dim, dtype=dtype, device=device)[pad:]
        # past the last layer, VALUE_PAD rows never handed out: the compiled decode step reads
        # that far past a run of values (and zeroes what it read; precache.models.step_attention)
        rows = (pad + num_layers) * n
        flat = torch.empty((rows + VALUE_PAD) * self.kv_width, dtype=dtype, device=device)
        self.v = flat[: rows * self.kv_width].view(pad + num_layers, n, num_kv_heads, head_dim)[pad:]
        self.lr = torch.empty(pad + num_layers, n, self.lr_width, dtype=dtype, device=device)[pad:]
        self.allocator = BlockAllocator(num_blocks)
        self._lr_widths = {a: rk + rv for a, (rk, rv) in lr_ranks.items()}
        #: the agents' LR down-projections side by side, per layer and adapter set
        #: (:class:`~precache.cache.planned_attention` writes every agent's LR rows in one product)
        self.fused_lr_down: dict[tuple, tuple] = {}
        #: the compiled decode step's LoRA stacks and LR down-projections (:mod:`precache.cache.step_inputs`)
        self.step_cache: dict = {}
        self._stores: weakref.WeakSet[PagedStore] = weakref.WeakSet()

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (the budget actually allocated)."""
        return self.num_blocks * self.block_bytes

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def check_fits(self, n_blocks: int, what: str) -> None:
        """Raises :class:`CacheCapacityError` when ``n_blocks`` can never be held at once."""
        if n_blocks > self.num_blocks:
            raise CacheCapacityError(
                f"{what} needs {n_blocks} KV-cache blocks ({n_blocks * self.block_bytes} bytes) but the pool "
                f"holds {self.num_blocks} ({self.nbytes} bytes): raise kv_cache_bytes"
            )

    def assign_lr(self, agent: str, rank_k: int, rank_v: int) -> None:
        """Give a new agent LR columns: the narrowest free range that holds ``rank_k + rank_v``.
        What they hold in every block is garbage until a forward writes the agent's LR rows.

        Raises:
            CacheCapacityError: no free range is wide enough (reserve spare slots when the pool is made).
        """
        need = rank_k + rank_v
        fits = [r for r in self.free_lr if r[1] >= need]
        if not fits:
            raise CacheCapacityError(
                f"no free LR-cache columns for adapter '{agent}' (key rank {rank_k} + value rank {rank_v}): "
                f"the pool reserved {len(self.free_lr)} free slot(s) "
                f"(widths {sorted(w for _, w in self.free_lr)}); raise max_adapters / max_lora_rank"
            )
        start, width = min(fits, key=lambda r: r[1])
        self.free_lr.remove((start, width))
        self.lr_cols[agent] = (slice(start, start + rank_k), slice(start + rank_k, start + need))
        self._lr_widths[agent] = width

    def release_lr(self, agent: str) -> None:
        """Give an agent's LR columns back (they keep their garbage until a new owner writes them)."""
        cols_k, _ = self.lr_cols.pop(agent)
        self.free_lr.append((cols_k.start, self._lr_widths.pop(agent)))
        self.fused_lr_down.clear()  # it holds the unloaded adapter
        self.step_cache.clear()

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every layer's keys, values and LR rows of block ``src`` into ``dst``."""
        bs = self.block_size
        s, d = slice(src * bs, src * bs + bs), slice(dst * bs, dst * bs + bs)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]
        self.lr[:, d] = self.lr[:, s]

    def usage(self) -> dict[str, int]:
        """Bytes: ``total`` (the pool), ``allocated`` (blocks held by a trajectory), ``used``
        (positions of held blocks that hold a committed token), ``shared`` (blocks held by more
        than one table, counted once), ``cached`` (unheld blocks kept for prefix reuse), ``free``."""
        a, bs = self.allocator, self.block_size
        filled: dict[int, int] = {}
        with a.lock:  # one consistent picture, even while other threads release sessions
            for store in list(self._stores):
                for i, block in enumerate(store.blocks):
                    n = min(bs, max(0, store.length - store.offset - i * bs))
                    filled[block] = max(filled.get(block, 0), n)
            counts = (a.num_held, sum(1 for r in a.ref if r > 1), len(a.cached), len(a.free))
        held, shared, cached, free = counts
        return {
            "total": self.nbytes,
            "allocated": held * self.block_bytes,
            "used": sum(filled.values()) * self.token_bytes,
            "shared": shared * self.block_bytes,
            "cached": cached * self.block_bytes,
            "free": free * self.block_bytes,
        }


def _release_all(allocator: BlockAllocator, blocks: list[int]) -> None:
    for block in blocks:
        allocator.release(block)
    blocks.clear()


class PagedStore:
    """One trajectory's cache (a base cache, or a full K/V cache) over pool blocks.

    Positions ``[offset, length)`` are committed; position ``p`` lives in row
    ``blocks[(p - offset) // block_size] * block_size + (p - offset) % block_size`` of the pool.
    ``offset`` > 0 for a cache that starts mid-trajectory (ReBaseShared's turn-local full cache).
    The blocks go back to the pool when the store is released or garbage-collected.
    """

    def __init__(self, pool: KVPool, offset: int = 0):
        self.pool, self.offset, self.length = pool, offset, offset
        self.blocks: list[int] = []
        self._finalizer = weakref.finalize(self, _release_all, pool.allocator, self.blocks)
        with pool.allocator.lock:
            pool._stores.add(self)

    # -- blocks ----------------------------------------------------------------------------------
    def reserve(self, end: int) -> None:
        """Hold enough blocks for positions up to ``end``.

        Raises:
            OutOfBlocksError: the pool has no block left to hand out.
        """
        need = self.pool.blocks_for(end - self.offset)
        alloc = self.pool.allocator
        while len(self.blocks) < need:
            self.blocks.append(alloc.allocate(after=self.blocks[-1] if self.blocks else None))

    def prepare_write(self, start: int, end: int) -> None:
        """Make the blocks over positions ``[start, end)`` writable by this store alone: reserve
        them, copy shared ones (copy-on-write) and drop the prefix hash of registered ones."""
        self.reserve(end)
        alloc, bs = self.pool.allocator, self.pool.block_size
        for i in range((start - self.offset) // bs, self.pool.blocks_for(end - self.offset)):
            block = self.blocks[i]
            if alloc.is_shared(block):
                fresh = alloc.allocate(after=self.blocks[i - 1] if i else None)
                self.pool.copy_block(block, fresh)
                alloc.release(block)
                self.blocks[i] = fresh
            else:
                alloc.unregister(block)

    def commit(self, length: int) -> None:
        """Declare positions up to ``length`` written at every layer."""
        self.length = length

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (DESIGN.md fact 6) and release the blocks past it."""
        self.length = max(self.offset, min(self.length, length))
        keep = self.pool.blocks_for(self.length - self.offset)
        for block in self.blocks[keep:]:
            self.pool.allocator.release(block)
        del self.blocks[keep:]

    def release(self) -> None:
        """Give every block back (the store is empty afterwards)."""
        _release_all(self.pool.allocator, self.blocks)
        self.length = self.offset

    def fork(self, length: int | None = None) -> PagedStore:
        """A new store holding this store's blocks over positions ``[offset, length)`` (default: all):
        O(1) in cache memory; the first write to a shared block copies it."""
        length = self.length if length is None else min(length, self.length)
        child = PagedStore(self.pool, self.offset)
        for block in self.blocks[: self.pool.blocks_for(length - self.offset)]:
            self.pool.allocator.hold(block)
            child.blocks.append(block)
        child.length = max(self.offset, length)
        return child

    def nbytes(self) -> int:
        """Bytes of the blocks this store holds (allocated, shared blocks included)."""
        return len(self.blocks) * self.pool.block_bytes

    # -- addressing ------------------------------------------------------------------------------
    def runs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(first position, end position, first pool row)`` of each contiguous piece of ``[start, end)``."""
        bs, out = self.pool.block_size, []
        p = start
        while p < end:
            i, off = divmod(p - self.offset, bs)
            row = self.blocks[i] * bs + off
            stop = min(end, p + bs - off)
            if out and out[-1][1] == p and out[-1][2] + (p - out[-1][0]) == row:
                out[-1] = (out[-1][0], stop, out[-1][2])
            else:
                out.append((p, stop, row))
            p = stop
        return out

    def rows(self, start: int, end: int) -> slice | torch.Tensor:
        """Pool rows of positions ``[start, end)``: a slice when contiguous, else an index tensor."""
        return rows_of(self.runs(start, end), self.pool.device)

    def kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (after RoPE) and values at positions ``[start, end)``: ``[end - start, n_kv_heads, head_dim]``."""
        rows = self.rows(start, end)
        return self.pool.k[layer][rows], self.pool.v[layer][rows]


def rows_of(runs: list[tuple[int, int, int]], device: torch.device) -> slice | torch.Tensor:
    """Pool rows of ``runs`` (:meth:`PagedStore.runs`): a slice when there is at most one piece,
    else an index tensor on ``device``."""
    if len(runs) <= 1:
        s, e, row = runs[0] if runs else (0, 0, 0)
        return slice(row, row + (e - s))
    return torch.cat([torch.arange(r, r + (e - s)) for s, e, r in runs]).to(device)


class LRView:
    """Agent ``agent``'s LR cache: ``Lk = h A^k`` ``[n, r_k]`` and ``Lv = h A^v`` ``[n, r_v]`` per
    layer, stored in the LR columns of ``store``'s blocks, committed up to its own ``length``
    (BaseShared's LR caches lag the base; the other methods keep them equal)."""

    def __init__(self, store: PagedStore, agent: str, length: int = 0):
        self.store, self.agent, self.length = store, agent, length
        self.cols_k, self.cols_v = store.pool.lr_cols[agent]
        self.rank_k = self.cols_k.stop - self.cols_k.start
        self.rank_v = self.cols_v.stop - self.cols_v.start

    def commit(self, length: int) -> None:
        self.length = length

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def lr(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``Lk`` ``[end - start, r_k]`` and ``Lv`` ``[end - start, r_v]`` at positions ``[start, end)``."""
        rows = self.store.rows(start, end)
        lr = self.store.pool.lr[layer][rows]
        return lr[:, self.cols_k], lr[:, self.cols_v]

    def nbytes(self) -> int:
        """Bytes of this agent's columns in the blocks of its store."""
        pool = self.store.pool
        itemsize = torch.finfo(pool.dtype).bits // 8
        cols = self.rank_k + self.rank_v
        return len(self.store.blocks) * pool.block_size * pool.num_layers * cols * itemsize
