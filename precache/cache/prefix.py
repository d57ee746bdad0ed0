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
            self.hashes.append(block_hash(parent, token_ids[i * block_size : (i + 1) * block_size]))
        return self.hashes[:n_blocks]

    def truncate(self, n_tokens: int, block_size: int) -> None:
        del self.hashes[n_tokens // block_size :]

    def fork(self, n_tokens: int, block_size: int) -> PrefixChain:
        return PrefixChain(self.key, self.hashes[: n_tokens // block_size], self.salt)


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def block_hash(parent: int, block: list[int]) -> int:
    """The hash of a block of token ids under its parent's hash (the chain's only hash function)."""
    return _digest(parent.to_bytes(16, "little") + repr(list(map(int, block))).encode())


def chain_hashes(token_ids: list[int], block_size: int, key: str, salt: str | None = None) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` in the chain of cache ``key`` under tenant ``salt``:
    ``out[i]`` names the tokens ``[0, (i + 1) block_size)`` (a last partial block has none).

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    return PrefixChain(key, salt=salt).extend(token_ids, len(token_ids) // block_size, block_size)


class TrajectoryIndex:
    """Trajectories by key (the server's sessions), found through the same salted hash chain that
    names published cache blocks: a prompt's chain hashes reach every key of its tenant that shares
    full blocks with it, then the common prefix is counted token by token inside the first block
    that differs. Keys that share less than a block are found by the first token. Plain Python.
    """

    def __init__(self, block_size: int, key: str = "trajectory"):
        self.block_size, self.key = block_size, key
        self._paths: dict = {}  # key -> (token ids, chain hashes, salt)
        self._by_hash: dict[int, set] = {}
        self._by_first: dict[tuple, set] = {}

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, key) -> bool:
        return key in self._paths

    def set(self, key, token_ids: list[int], salt: str | None = None) -> None:
        """Index ``token_ids`` as the trajectory of ``key`` (tenant ``salt``), replacing what it had."""
        tokens = [int(t) for t in token_ids]
        kept: list[int] = []
        if key in self._paths and self._paths[key][2] == salt:  # hash only the blocks that changed
            old_tokens, old_hashes, _ = self._paths[key]
            kept = old_hashes[: common_prefix(old_tokens, tokens) // self.block_size]
        self.remove(key)
        chain = PrefixChain(self.key, list(kept), salt)
        hashes = chain.extend(tokens, len(tokens) // self.block_size, self.block_size)
        self._paths[key] = (tokens, hashes, salt)
        for h in hashes:
            self._by_hash.setdefault(h, set()).add(key)
        if tokens:
            self._by_first.setdefault((salt, tokens[0]), set()).add(key)

    def remove(self, key) -> None:
        """Forget ``key`` (no error when absent)."""
        if key not in self._paths:
            return
        tokens, hashes, salt = self._paths.pop(key)
        for h in hashes:
            self._discard(self._by_hash, h, key)
        if tokens:
            self._discard(self._by_first, (salt, tokens[0]), key)

    def match(self, token_ids: list[int], salt: str | None = None) -> list[tuple[object, int]]:
        """``(key, common prefix length)`` of every key of tenant ``salt`` sharing at least one token
        with ``token_ids``, longest first."""
        if not token_ids:
            return []
        alive = set(self._by_first.get((salt, int(token_ids[0])), ()))
        found: list[tuple[object, int]] = []
        bs = self.block_size
        for depth, h in enumerate(chain_hashes(token_ids, bs, self.key, salt) + [None]):
            deeper = alive & self._by_hash.get(h, set()) if h is not None else set()
            for key in alive - deeper:  # shares ``depth`` full blocks, then differs inside the next
                path = self._paths[key][0]
                start = depth * bs
                found.append(
                    (key, start + common_prefix(path[start : start + bs], token_ids[start : start + bs]))
                )
            alive = deeper
            if not alive:
                break
        return sorted(found, key=lambda kv: -kv[1])

    @staticmethod
    def _discard(index: dict, where, key) -> None:
        keys = index.get(where)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del index[where]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token-id sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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
