"""The block allocator and the paged stores against brute-force models (random operations).

The allocator's rules (precache/cache/blocks.py) and the pool's (precache/cache/pool.py): a
held block is never handed out twice, reference counts equal the number of tables holding a block,
the pool never holds more blocks than its budget, a fork reads exactly its parent's tokens, and
``usage()`` equals the bytes actually held.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precache.cache.blocks import BlockAllocator
from precache.cache.pool import KVPool, PagedStore
from precache.errors import CacheCapacityError, OutOfBlocksError

L, H, D, BS = 2, 2, 4, 4
RANKS = {"plan": (2, 3), "act": (0, 1)}


def small_pool(num_blocks: int) -> KVPool:
    probe = KVPool(L, H, D, RANKS, 1 << 30, BS)
    return KVPool(L, H, D, RANKS, num_blocks * probe.block_bytes + probe.block_bytes - 1, BS)


def test_pool_size_comes_from_the_byte_budget():
    pool = small_pool(7)
    # a block: 4 positions x 2 layers x (K + V: 2 x 2 heads x 4 + LR: 2 + 3 + 0 + 1) fp32 values
    assert pool.block_bytes == BS * L * (2 * H * D + 6) * 4
    assert pool.num_blocks == 7 and pool.nbytes == 7 * pool.block_bytes
    assert pool.k.shape == (L, 7 * BS, H, D) and pool.lr.shape == (L, 7 * BS, 6)
    with pytest.raises(CacheCapacityError, match="kv_cache_bytes"):
        KVPool(L, H, D, RANKS, pool.block_bytes - 1, BS)
    with pytest.raises(CacheCapacityError, match="needs 8 KV-cache blocks"):
        pool.check_fits(8, "this request")


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "hold", "release", "register", "lookup"]), st.integers(0, 10**6)),
    max_size=80,
)


@settings(max_examples=80, deadline=None)
@given(ops)
def test_allocator_against_a_brute_force_model(program):
    n = 6
    alloc = BlockAllocator(n)
    ref = [0] * n
    names: dict[int, int] = {}  # block -> hash
    for op, x in program:
        held = [b for b in range(n) if ref[b] > 0]
        if op == "alloc":
            if all(r > 0 for r in ref):
                with pytest.raises(OutOfBlocksError):
                    alloc.allocate()
                continue
            b = alloc.allocate(after=x % n if x % 2 else None)
            assert ref[b] == 0, "a held block was handed out again"
            names.pop(b, None)  # a reused cached block loses its name
            ref[b] = 1
        elif op == "hold" and held:
            b = held[x % len(held)]
            alloc.hold(b)
            ref[b] += 1
        elif op == "hold":
            cached = [b for b in names if ref[b] == 0]
            if cached:
                b = cached[x % len(cached)]
                alloc.hold(b)  # a prefix-cache hit takes a cached block back
                ref[b] = 1
        elif op == "release" and held:
            b = held[x % len(held)]
            alloc.release(b)
            ref[b] -= 1
        elif op == "register" and held:
            b, h = held[x % len(held)], x % 7
            ok = alloc.register(b, h)
            assert ok == (b not in names and h not in names.values())
            if ok:
                names[b] = h
        elif op == "lookup":
            h = x % 7
            owner = [b for b, hh in names.items() if hh == h]
            assert alloc.lookup(h) == (owner[0] if owner else None)
        assert alloc.ref == ref
        assert alloc.num_held == sum(r > 0 for r in ref)
        assert set(alloc.cached) == {b for b in names if ref[b] == 0}
        assert alloc.free == {b for b in range(n) if ref[b] == 0 and b not in names}
        assert alloc.num_available + alloc.num_held == n


store_ops = st.lists(
    st.tuples(
        st.sampled_from(["append", "fork", "free", "truncate", "publish", "write"]), st.integers(0, 10**6)
    ),
    max_size=40,
)


def _fill(store: PagedStore, start: int, end: int, tag: float) -> None:
    store.prepare_write(start, end)
    rows = store.rows(start, end)
    values = tag + torch.arange(start, end, dtype=torch.float32)
    for layer in range(L):
        store.pool.k[layer][rows] = values[:, None, None] + layer
        store.pool.lr[layer][rows] = values[:, None] - layer
    store.commit(max(store.length, end))


@settings(max_examples=60, deadline=None)
@given(store_ops)
def test_pool_stays_in_budget_and_forks_read_their_own_tokens(program):
    """Random append / fork / free / truncate / publish / overwrite sequences on 12 blocks: every
    store reads back exactly what its own history wrote, and the pool never holds more than it has."""
    pool = small_pool(12)
    stores: list[tuple[PagedStore, list[float]]] = []  # store, expected key per position
    for op, x in program:
        try:
            if op == "append" or not stores:
                if not stores or x % 3 == 0:
                    stores.append((PagedStore(pool), []))
                store, expect = stores[x % len(stores)]
                n = 1 + x % 9
                tag = float(x % 1000) * 100
                _fill(store, store.length, store.length + n, tag)
                expect.extend(tag + p for p in range(len(expect), len(expect) + n))
            elif op == "fork":
                store, expect = stores[x % len(stores)]
                cut = x % (store.length + 1)
                stores.append((store.fork(cut), expect[:cut]))
            elif op == "free":
                store, _ = stores.pop(x % len(stores))
                store.release()
            elif op == "truncate":
                store, expect = stores[x % len(stores)]
                store.truncate(x % (store.length + 1))
                del expect[store.length :]
            elif op == "write" and stores[x % len(stores)][0].length:
                store, expect = stores[x % len(stores)]
                p = x % store.length  # overwrite one committed position: copy-on-write if shared
                tag = 10**6 + float(x % 1000)
                _fill(store, p, p + 1, tag - p)
                expect[p] = tag
            elif op == "publish":
                store, _ = stores[x % len(stores)]
                for i, b in enumerate(store.blocks[: store.length // BS]):
                    pool.allocator.register(b, hash((id(store), i, x)))
        except OutOfBlocksError:
            pass  # the pool is full: the operation is refused, nothing else changes
        held = {b for s, _ in stores for b in s.blocks}
        assert len(held) <= pool.num_blocks
        usage = pool.usage()
        assert usage["allocated"] == len(held) * pool.block_bytes
        assert usage["allocated"] + usage["cached"] + usage["free"] == usage["total"] == pool.nbytes
        refs = {b: sum(s.blocks.count(b) for s, _ in stores) for b in held}
        assert all(pool.allocator.ref[b] == n for b, n in refs.items())
        assert usage["shared"] == sum(n > 1 for n in refs.values()) * pool.block_bytes
        for store, expect in stores:
            assert store.length == len(expect)
            if expect:
                k, _ = store.kv(1, 0, store.length)
                assert k[:, 0, 0].tolist() == [e + 1 for e in expect]


def test_a_fork_costs_no_block_until_it_writes():
    pool = small_pool(8)
    parent = PagedStore(pool)
    _fill(parent, 0, 10, 0.0)  # 3 blocks, the last one partial
    assert pool.usage()["allocated"] == 3 * pool.block_bytes
    child = parent.fork()
    assert (
        pool.usage()["allocated"] == 3 * pool.block_bytes and pool.usage()["shared"] == 3 * pool.block_bytes
    )
    _fill(child, 10, 11, 500.0)  # writes into the shared partial block: only that block is copied
    assert pool.usage()["allocated"] == 4 * pool.block_bytes
    assert child.blocks[:2] == parent.blocks[:2] and child.blocks[2] != parent.blocks[2]
    parent.release()
    k, _ = child.kv(0, 0, 11)
    assert k[:, 0, 0].tolist() == [float(p) for p in range(10)] + [510.0]
    assert pool.usage()["allocated"] == 3 * pool.block_bytes and pool.usage()["shared"] == 0


def test_unheld_published_blocks_are_evicted_least_recently_used_first():
    pool = small_pool(3)
    a, b = PagedStore(pool), PagedStore(pool)
    _fill(a, 0, 4, 0.0)
    _fill(b, 0, 4, 0.0)
    pool.allocator.register(a.blocks[0], 1)
    pool.allocator.register(b.blocks[0], 2)
    first, second = a.blocks[0], b.blocks[0]
    a.release()
    b.release()  # both cached; a's is the least recently released
    assert pool.usage()["cached"] == 2 * pool.block_bytes
    c = PagedStore(pool)
    _fill(c, 0, 8, 0.0)  # the free block, then an eviction
    assert pool.allocator.lookup(1) is None and pool.allocator.lookup(2) == second
    assert first in c.blocks
    with pytest.raises(OutOfBlocksError):
        _fill(c, 8, 13, 0.0)
