"""The block allocator: reference counts, a prefix-hash table and LRU eviction, in plain Python.

No torch here (nano-vllm's ``block_manager`` habit): the rules are checked by tests that run random
operations against a brute-force model (tests/test_blocks.py).

Rules:
- A block is in exactly one of three states: *free* (no content anyone can ask for), *held*
  (reference count > 0) or *cached* (count 0, but registered under a prefix hash, so a later
  trajectory with the same prefix can take it back; evicted least recently used first).
- Only full, final blocks are registered; a hash names at most one block and a block at most one hash.
- A held block with count > 1 is read-only: a writer copies it first (copy-on-write, the caller's
  job: :meth:`BlockAllocator.is_shared`).
- :meth:`allocate` never hands out a held block; it raises :class:`OutOfBlocksError` when every
  block is held.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from precache.errors import CacheIntegrityError, OutOfBlocksError


def _locked(method):
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


class BlockAllocator:
    """``num_blocks`` block ids ``[0, num_blocks)``.

    New runs of blocks start in the middle of the largest free gap and grow into the next id
    (:meth:`allocate` with ``after``), so each trajectory's table stays mostly contiguous and a CPU
    backend can read it as a few slices instead of gathering token by token.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free: set[int] = set(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # count-0 registered blocks, LRU first
        self.hash_of: dict[int, int] = {}
        self.block_of: dict[int, int] = {}
        # sessions die on any thread (their blocks are released by a finalizer) while one thread
        # steps the engine: every change holds this lock (re-entrant: a finalizer may run inside one)
        self.lock = threading.RLock()

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return self.num_blocks - len(self.free) - len(self.cached)

    @property
    def num_available(self) -> int:
        """Blocks :meth:`allocate` can hand out now (free, or cached and evictable)."""
        return len(self.free) + len(self.cached)

    def is_shared(self, block: int) -> bool:
        """More than one holder: a write must copy the block first."""
        return self.ref[block] > 1

    def lookup(self, prefix_hash: int) -> int | None:
        """The block registered under ``prefix_hash``, held or cached, or None."""
        return self.block_of.get(prefix_hash)

    @_locked
    def check(self, holders: dict[int, int] | None = None) -> None:
        """The integrity check of the rules above; ``holders`` (block -> tables holding it, when the
        caller knows them) must equal the reference counts of held blocks.

        Raises:
            CacheIntegrityError: a rule does not hold (the message names the block).
        """
        for block in range(self.num_blocks):
            states = (self.ref[block] > 0) + (block in self.free) + (block in self.cached)
            if states != 1 or self.ref[block] < 0:
                raise CacheIntegrityError(f"block {block} is in {states} states (ref {self.ref[block]})")
            if block in self.cached and block not in self.hash_of:
                raise CacheIntegrityError(f"cached block {block} has no prefix hash")
            if block in self.free and block in self.hash_of:
                raise CacheIntegrityError(f"free block {block} still has a prefix hash")
        if any(self.block_of.get(h) != b for b, h in self.hash_of.items()) or len(self.block_of) != len(
            self.hash_of
        ):
            raise CacheIntegrityError("the prefix-hash table is not one-to-one")
        if holders is not None:
            held = {b: r for b, r in enumerate(self.ref) if r}
            if held != {b: n for b, n in holders.items() if n}:
                raise CacheIntegrityError("reference counts differ from the tables that hold the blocks")

    # -- changes -------------------------------------------------------------------------------
    @_locked
    def allocate(self, after: int | None = None) -> int:
        """Hold a new block (count 1), preferably ``after + 1``; evict the LRU cached block when
        nothing is free.

        Raises:
            OutOfBlocksError: every block is held.
        """
        if after is not None and after + 1 in self.free:
            block = after + 1
        elif self.free:
            block = self._gap_start()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            self._unregister(block)
            self.free.add(block)
        else:
            raise OutOfBlocksError(f"all {self.num_blocks} KV-cache blocks are in use")
        self.free.discard(block)
        self.ref[block] = 1
        return block

    @_locked
    def held_before_free(self) -> list[int]:
        """Held blocks whose next id is free (where a table grows next)."""
        return [b for b in range(self.num_blocks - 1) if self.ref[b] > 0 and b + 1 in self.free]

    @_locked
    def hold(self, block: int) -> None:
        """One more holder of ``block`` (a fork, or a prefix-cache hit on a cached block)."""
        if self.ref[block] == 0:
            if block not in self.cached:
                raise ValueError(f"block {block} is free: nothing to share")
            del self.cached[block]
        self.ref[block] += 1

    @_locked
    def release(self, block: int) -> None:
        """One holder fewer; at zero the block is cached (if registered) or freed."""
        if self.ref[block] <= 0:
            raise ValueError(f"block {block} is not held")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if block in self.hash_of:
                self.cached[block] = None
            else:
                self.free.add(block)

    @_locked
    def register(self, block: int, prefix_hash: int) -> bool:
        """Name held ``block`` by ``prefix_hash``; False when the hash or the block already has one."""
        if prefix_hash in self.block_of or block in self.hash_of:
            return False
        self.block_of[prefix_hash], self.hash_of[block] = block, prefix_hash
        return True

    @_locked
    def unregister(self, block: int) -> None:
        """Drop ``block``'s hash before its sole holder rewrites it in place."""
        self._unregister(block)

    def _unregister(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]

    def _gap_start(self) -> int:
        """The middle of the largest run of free ids (a new table's first block)."""
        best_start, best_len, start, prev = 0, 0, None, None
        for b in sorted(self.free):
            if prev is None or b != prev + 1:
                start = b
            if b - start + 1 > best_len:
                best_start, best_len = start, b - start + 1
            prev = b
        if best_start == 0:
            return 0
        return best_start + best_len // 2 if best_len > 2 else best_start
