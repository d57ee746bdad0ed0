"""Host swap space: the bounded host memory that swapped-out caches live in (vLLM's ``swap_space``).

Swapping a trajectory out of the block pool (:mod:`precache.cache.swap`) copies its blocks to host
memory. Without a bound, many idle conversations would fill the machine: a 5,000-token NonShared
trajectory of SmolLM2 holds about 230 MB at fp32. :class:`SwapSpace` keeps the host copies within
``capacity_bytes``: before a swap-out would pass it, the least recently used swapped-out *idle*
sessions are dropped: their host copies are freed and only their tokens and authors are kept.
When a dropped session's next request starts, its caches are rebuilt from those tokens
(:meth:`~precache.methods.base.SharingMethod.rebuild`: each run of tokens prefilled by its author,
so the next turn's greedy tokens are those of a run that never dropped them).

A preempted request's copies (a turn open on them) are counted but never dropped: they come back
before any younger request starts, and at most ``max_running`` exist. An idle session whose copies
alone pass the budget is dropped at once instead of swapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import weakref
from collections import OrderedDict

from precache.cache.plan import blocks_needed
from precache.cache.pool import KVPool
from precache.cache.swap import swap_in, swap_out

logger = logging.getLogger(__name__)

#: share of the machine's physical memory the default swap space may take
HOST_SWAP_SHARE = 0.25
#: a swap space with no bound (a scheduler built without one)
UNBOUNDED_SWAP_SPACE = 2**63 - 1


def physical_memory_bytes() -> int:
    """Physical memory of this machine in bytes (psutil when installed, else ``os.sysconf``)."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere: macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_freed_host_memory() -> None:
    """Hand the heap memory freed host copies leave behind back to the OS (glibc's ``malloc_trim``).
    glibc raises its mmap threshold to the size of a freed large block, so later copies of that
    size come from the heap, and freeing them does not lower the process's RSS: 30 swap-outs of
    24 MiB with 10 kept held 267 MiB of RSS without a trim and 72 MiB with one (measured here)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def default_swap_space_bytes() -> int:
    """:data:`HOST_SWAP_SHARE` of the machine's physical memory, in bytes."""
    return int(physical_memory_bytes() * HOST_SWAP_SHARE)


def check_swap_space_bytes(value) -> int:
    """``value`` as a swap budget in bytes.

    Raises:
        ValueError: ``value`` is not an integer >= 0 (naming ``swap_space_bytes``).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"swap_space_bytes must be an integer number of bytes >= 0, got {value!r}")
    return value


class SwapSpace:
    """Swapped-out sessions of one engine, least recently used first, their host copies within
    ``capacity_bytes`` (bytes; 0: nothing is kept in host memory, every idle swap-out drops).

    Counters over the engine's life: ``swap_outs`` (sessions swapped out), ``drops`` (sessions whose
    host copies were dropped), ``rebuilt_tokens`` (tokens prefilled again to rebuild dropped
    caches), ``peak_bytes`` (the most host bytes held at once). Entries hold sessions weakly: a
    session collected while swapped out frees its copies with it.
    """

    def __init__(self, pool: KVPool | None, capacity_bytes: int):
        self.pool, self.capacity_bytes = pool, check_swap_space_bytes(capacity_bytes)
        self._entries: OrderedDict[int, weakref.ref] = OrderedDict()
        self.swap_outs = self.drops = self.rebuilt_tokens = self.peak_bytes = 0

    # -- accounting ------------------------------------------------------------------------------
    def _live(self) -> list:
        sessions = []
        for key, ref in list(self._entries.items()):
            s = ref()
            if s is None or s.swapped is None:
                del self._entries[key]
            else:
                sessions.append(s)
        return sessions

    @property
    def used_bytes(self) -> int:
        """Host bytes the swapped-out sessions' copies take now."""
        return sum(s.swapped.nbytes for s in self._live())

    def usage(self) -> dict[str, int]:
        """``{"capacity", "used", "peak", "sessions", "swap_outs", "drops", "rebuilt_tokens"}``
        (bytes, sessions swapped out now, then counts over the engine's life)."""
        live = self._live()
        return {
            "capacity": self.capacity_bytes,
            "used": sum(s.swapped.nbytes for s in live),
            "peak": self.peak_bytes,
            "sessions": len(live),
            "swap_outs": self.swap_outs,
            "drops": self.drops,
            "rebuilt_tokens": self.rebuilt_tokens,
        }

    # -- moving caches ---------------------------------------------------------------------------
    def swap_out(self, session) -> int:
        """Swap ``session``'s caches out of the pool, dropping least recently used idle sessions (or,
        idle and too large alone, this one) to stay within the budget; return the blocks freed."""
        stores = session.state.paged_stores()
        need = len({b for s in stores for b in s.blocks}) * self.pool.block_bytes
        for victim in self._live():
            if self.used_bytes + need <= self.capacity_bytes:
                break
            if victim.active is None:
                self.drop(victim)
        before = self.pool.allocator.num_available
        if session.active is None and self.used_bytes + need > self.capacity_bytes:
            session.drop_caches()
            self.drops += 1
            logger.debug("session %s dropped: its %d host bytes pass the swap space", session.id, need)
        else:
            session.note_swapped(swap_out(self.pool, stores))
            self._entries[id(session)] = weakref.ref(session)
            self.swap_outs += 1
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return self.pool.allocator.num_available - before

    def swap_in(self, session) -> None:
        """Copy ``session``'s caches back into the pool (no-op when they are not swapped out).

        Raises:
            OutOfBlocksError: the pool cannot hand out the blocks now (nothing is changed).
        """
        if session.swapped is not None:
            swap_in(self.pool, session.swapped)
            self.forget(session)

    def forget(self, session) -> None:
        """Free ``session``'s host copies, if any (it was swapped in or closed)."""
        held = session.swapped is not None
        session.note_swapped(None)
        self._entries.pop(id(session), None)
        if held:
            release_freed_host_memory()

    def drop(self, session) -> None:
        """Free an idle session's host copies; its caches are rebuilt at its next request."""
        self.forget(session)
        session.drop_caches()
        self.drops += 1
        logger.debug("dropped the swapped-out caches of session %s (least recently used)", session.id)

    # -- rebuilding ------------------------------------------------------------------------------
    def rebuild_plans(self, session, agent: str | None) -> list:
        """Rows that rebuild a dropped session's caches before ``agent``'s turn (empty when none are
        dropped, or the method starts such a trajectory over)."""
        if not session.dropped:
            return []
        plans = session.method.rebuild(session.state, agent, session.token_ids, session.authors)
        return plans or []

    def rebuild_blocks(self, session, agent: str | None) -> int:
        """Pool blocks :meth:`rebuild_plans` would take."""
        return blocks_needed(self.rebuild_plans(session, agent))

    def rebuild(self, session, agent: str | None, forward) -> int:
        """Rebuild a dropped session's caches with ``forward(plans)`` (one batched forward; no-op
        when none are dropped); return the tokens prefilled. A method with no exact rebuild starts
        the trajectory over: its authors are forgotten and the next turn prefills every token.

        Raises:
            OutOfBlocksError: the pool cannot hold the rebuilt caches (the session stays dropped).
        """
        if not session.dropped:
            return 0
        plans = session.method.rebuild(session.state, agent, session.token_ids, session.authors)
        if plans:
            forward(plans)
        session.note_rebuilt(exact=plans is not None)
        tokens = sum(len(p.token_ids) for p in plans or [])
        self.rebuilt_tokens += tokens
        return tokens
