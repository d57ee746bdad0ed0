"""Cross-trajectory prefix reuse over pool blocks: a chain of hashes names each full block by the
tokens of its whole prefix (and a key naming which cache it is), so a later trajectory with the same
token prefix takes the blocks back instead of prefilling them (vLLM's automatic prefix caching,
keyed here by cache rather than by adapter: a base block is reused whichever adapter wrote it).

Rules: only full blocks below a store's committed length are published; a trajectory attaches
blocks only at a block boundary and never its last prompt token (the turn must compute its logits).

Tenants: a chain starts from a seed that mixes in the trajectory's ``salt`` (the server's tenant:
a request's ``cache_salt`` and/or its API key, as vLLM salts the first block's hash), so two tenants'
chains never name the same block and a lookup never reaches another tenant's blocks. The hashes are
BLAKE2b digests (128 bits), not Python's ``hash``: a client cannot craft token blocks whose hash
collides with another trajectory's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from precache.cache.pool import PagedStore


@dataclass
class PrefixChain:
    """Hashes of the first full blocks of one trajectory's cache ``key`` under tenant ``salt``
    (None: the default tenant): ``hashes[i]`` names the tokens ``[0, (i + 1) block_size)``."""

    key: str
    hashes: list[int] = field(default_factory=list)
    salt: str | None = None

    def seed(self) -> int:
        """The chain's root: the cache key and the tenant salt (the parent of the first block)."""
        return _digest(repr(("precache", self.key, self.salt)).encode())

    def extend(self, token_ids: list[int], n_blocks: int, block_size: int) -> list[int]:
        """Hashes of the first ``n_blocks`` blocks of ``token_ids`` (computing only the new ones)."""
        for i in range(len(self.hashes), n_blocks):
            parent = self.hashes[-1] if self.hashes else self.seed()
            block = token_ids[i * block_size : (i + 1) * block_size]
            self.hashes.append(_digest(parent.to_bytes(16, "little") + repr(list(map(int, block))).encode()))
        return self.hashes[:n_blocks]

    def truncate(self, n_tokens: int, block_size: int) -> None:
        del self.hashes[n_tokens // block_size :]

    def fork(self, n_tokens: int, block_size: int) -> PrefixChain:
        return PrefixChain(self.key, self.hashes[: n_tokens // block_size], self.salt)


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def publish(store: PagedStore, chain: PrefixChain, token_ids: list[int]) -> int:
    """Register the full committed blocks of ``store`` under their prefix hashes; return how many
    were newly registered (a block already named, or a prefix another block names, is left alone)."""
    bs = store.pool.block_size
    n = min((store.length - store.offset) // bs, len(store.blocks), len(token_ids) // bs)
    alloc = store.pool.allocator
    return sum(
        alloc.register(b, h) for b, h in zip(store.blocks, chain.extend(token_ids, n, bs), strict=False)
    )


def attach(store: PagedStore, chain: PrefixChain, token_ids: list[int]) -> int:
    """Take over published blocks that continue ``store`` with ``token_ids``' next full blocks, leaving
    at least the last token to prefill; return the new committed length (tokens)."""
    bs, alloc = store.pool.block_size, store.pool.allocator
    if store.offset or store.length % bs or len(store.blocks) != store.length // bs:
        return store.length
    limit = (len(token_ids) - 1) // bs  # full blocks before the last token
    hashes = chain.extend(token_ids, limit, bs)
    i = len(store.blocks)
    while i < limit:
        block = alloc.lookup(hashes[i])
        if block is None:
            break
        alloc.hold(block)
        store.blocks.append(block)
        i += 1
    store.commit(i * bs)
    return store.length
