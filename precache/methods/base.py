"""The interface every sharing method implements, and the cache state it works on.

A method answers three questions for the session (DESIGN.md, "The sharing methods"):
where the current agent's prefill starts (:meth:`SharingMethod.prefill_start`), which hidden
states feed which cache entries and which view each row reads (:meth:`SharingMethod.plans`), and
what runs after the turn (:meth:`SharingMethod.end_turn`). It never touches the model code.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from precache.cache.pool import DEFAULT_BLOCK_SIZE, KVPool, LRView, PagedStore
from precache.cache.prefix import PrefixChain, attach, publish
from precache.cache.rowplan import LRWrite, RowPlan, View
from precache.cache.views import materialise_view
from precache.errors import AdapterError, CacheIntegrityError, UnknownAdapterError
from precache.lora.adapter import LoRAAdapter

logger = logging.getLogger(__name__)


@dataclass
class CacheState:
    """All caches of one trajectory.

    ``base``: the shared base cache (None for NonShared); ``lr[a]``: agent a's LR cache;
    ``full[a]``: a full KV cache (NonShared: one per agent; FullShared: one under ``"shared"``);
    ``turn``: the current agent's exact adapted K/V over its own turn (ReBaseShared only);
    ``turn_start``: where the open turn started (None between turns); ``prefix``: the prefix
    hashes of the shared store's full blocks (cross-trajectory reuse); ``salt``: the tenant whose
    published blocks the trajectory may reuse and publish to (None: the default tenant;
    :mod:`precache.cache.prefix`).
    """

    base: PagedStore | None = None
    lr: dict[str, LRView] = field(default_factory=dict)
    full: dict[str, PagedStore] = field(default_factory=dict)
    turn: PagedStore | None = None
    turn_start: int | None = None
    prefix: dict[str, PrefixChain] = field(default_factory=dict)
    salt: str | None = None
    uids: dict[str, int] = field(default_factory=dict)
    late: set[str] = field(default_factory=set)
    version: int = 0

    def stores(self) -> list[PagedStore | LRView]:
        out = [self.base, self.turn, *self.lr.values(), *self.full.values()]
        return [s for s in out if s is not None]

    def paged_stores(self) -> list[PagedStore]:
        """The stores that hold pool blocks (the LR caches live in the base store's blocks), each once."""
        out = [self.base, self.turn, *self.full.values()]
        return list({id(s): s for s in out if s is not None}.values())


def author_runs(authors: list[str | None], known) -> list[tuple[int, int, str | None]]:
    """``authors`` as maximal runs ``(start, end, author)``, tokens ``[start, end)``; an author for
    which ``known(author)`` is false becomes None (the base model)."""
    runs: list[tuple[int, int, str | None]] = []
    for p, a in enumerate(authors):
        a = a if a is not None and known(a) else None
        if runs and runs[-1][2] == a:
            runs[-1] = (runs[-1][0], p + 1, a)
        else:
            runs.append((p, p + 1, a))
    return runs


#: share of a GPU's free memory the default block pool may take (the rest: activations, logits)
GPU_POOL_SHARE = 0.85


def device_capped(nbytes: int, device: torch.device | str) -> int:
    """``nbytes``, or at most :data:`GPU_POOL_SHARE` of ``device``'s free memory on CUDA (measured
    with ``torch.cuda.mem_get_info`` after the weights are loaded, as vLLM sizes its KV cache from
    ``gpu_memory_utilization``). Host memory is not probed: a CPU pool takes ``nbytes``."""
    device = torch.device(device)
    if device.type != "cuda":
        return nbytes
    free, _total = torch.cuda.mem_get_info(device)
    cap = int(free * GPU_POOL_SHARE)
    if cap < nbytes:
        logger.info(
            "default KV pool capped at %.1f GiB (%.0f%% of free GPU memory)",
            cap / 2**30,
            100 * GPU_POOL_SHARE,
        )
    return min(nbytes, cap)


class SharingMethod(ABC):
    """Base class: holds the model, the loaded adapters by agent name, and the block pool every
    trajectory's caches live in (``self.pool``, a :class:`~precache.cache.pool.KVPool`).

    ``kv_cache_bytes`` bounds the pool (bytes; default: room for ``n_agents + 2`` full-context
    caches, so one trajectory at the context length fits under every method, capped on a GPU by
    :func:`device_capped`); ``kv_cache_dtype`` is the dtype of its K/V and LR entries (default: the
    model's; :func:`precache.models.quant.resolve_kv_cache_dtype`); ``block_size`` is
    in tokens; ``prefix_caching`` lets a new trajectory take back the blocks another one published
    for the same token prefix (:meth:`reuse_prefix`; off for benchmarks that replay one stream
    several times). ``agent=None`` everywhere means the base model with no adapter.

    Raises:
        AdapterError: a split method with a k_proj LoRA on a model with a per-head k-norm (Qwen3).
        CacheCapacityError: ``kv_cache_bytes`` holds no block.
        ValueError: ``block_size`` is not an integer >= 1, or ``kv_cache_bytes`` not an integer.
    """

    name: ClassVar[str]
    #: :meth:`plans` of a token's author writes every cache entry of it (:meth:`rebuild` replays them)
    rebuilds_by_author: ClassVar[bool] = False
    #: methods that split K/V into base + LR cannot do so under Qwen3's per-head k-norm
    splits_kv: ClassVar[bool] = False

    def __init__(
        self,
        model,
        adapters: dict[str, LoRAAdapter],
        kv_cache_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_caching: bool = True,
        spare_lr_slots: int = 0,
        spare_lr_rank: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
    ):
        self.model, self.adapters, self.prefix_caching = model, adapters, prefix_caching
        cache_dtype = kv_cache_dtype or model.dtype
        self.adapter_uid = {a: i for i, a in enumerate(adapters)}  # one id per load of an adapter
        self._next_uid, self.version = len(adapters), 0
        c = model.config
        for name, adapter in adapters.items():
            self._check_adapter(name, adapter)
        for what, value in (("spare_lr_slots", spare_lr_slots), ("spare_lr_rank", spare_lr_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
        if not self.splits_kv:
            spare_lr_slots = spare_lr_rank = 0  # no LR columns to reserve
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1 (tokens per block), got {block_size!r}")
        if kv_cache_bytes is not None and (
            isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int)
        ):
            raise ValueError(f"kv_cache_bytes must be an integer number of bytes, got {kv_cache_bytes!r}")
        lr_ranks = {}
        if self.splits_kv:
            lr_ranks = {a: self.lr_ranks(ad) for a, ad in adapters.items()}
        if kv_cache_bytes is None:  # a full-context trajectory fits under every method
            itemsize = torch.finfo(cache_dtype).bits // 8
            lr_width = sum(map(sum, lr_ranks.values())) + 2 * spare_lr_slots * spare_lr_rank
            token_bytes = c.num_layers * (2 * c.num_kv_heads * c.head_dim + lr_width)
            blocks = (len(adapters) + 2) * -(-model.max_context // block_size)
            kv_cache_bytes = device_capped(blocks * block_size * token_bytes * itemsize, model.device)
        self.pool = KVPool(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            lr_ranks,
            kv_cache_bytes,
            block_size,
            cache_dtype,
            model.device,
            spare_lr_slots=spare_lr_slots,
            spare_lr_rank=spare_lr_rank,
        )

    def _check_adapter(self, name: str, adapter: LoRAAdapter) -> None:
        c = self.model.config
        if self.splits_kv and c.qk_norm and "k_proj" in adapter.targets:
            raise AdapterError(
                f"adapter '{name}' has a k_proj LoRA; under {self.name} the key is split into base + LR, "
                f"which the per-head k-norm of {c.model_type} does not allow (use v/q/o/MLP targets)"
            )

    @staticmethod
    def lr_ranks(adapter: LoRAAdapter) -> tuple[int, int]:
        """``(r_k, r_v)``: the LR cache columns an adapter needs (0 where it leaves k or v alone)."""
        return (
            adapter.rank if "k_proj" in adapter.targets else 0,
            adapter.rank if "v_proj" in adapter.targets else 0,
        )

    # -- adapters at run time (DESIGN.md, "Adapters loaded at run time") --------------------------
    def add_adapter(self, name: str, adapter: LoRAAdapter) -> None:
        """Register ``adapter`` as agent ``name`` (between steps). Existing trajectories get its
        caches at their next turn (:meth:`sync_state`), built as the method defines
        (:meth:`catch_up`).

        Raises:
            AdapterError: ``name`` is loaded already, or the adapter does not fit the method.
            CacheCapacityError: a split method has no free LR columns for its ranks.
        """
        if name in self.adapters:
            raise AdapterError(f"adapter '{name}' is loaded already (unload it first)")
        self._check_adapter(name, adapter)
        if self.splits_kv:
            self.pool.assign_lr(name, *self.lr_ranks(adapter))
        self.adapters[name] = adapter
        self.adapter_uid[name], self._next_uid = self._next_uid, self._next_uid + 1
        self.version += 1  # blocks published before hold no LR rows for it
        self.adapters_changed()

    def remove_adapter(self, name: str) -> None:
        """Forget agent ``name`` (between steps, with no request of it waiting or running): its
        caches are dropped from each trajectory at its next turn, its LR columns freed.

        Raises:
            UnknownAdapterError: ``name`` is not loaded.
        """
        if name not in self.adapters:
            raise UnknownAdapterError(f"adapter '{name}' is not loaded")
        del self.adapters[name], self.adapter_uid[name]
        if self.splits_kv:
            self.pool.release_lr(name)
        self.adapters_changed()

    def adapters_changed(self) -> None:
        """Hook after :meth:`add_adapter` / :meth:`remove_adapter` (default: nothing)."""
        return None

    def sync_state(self, state: CacheState) -> None:
        """Bring ``state``'s per-agent caches to the loaded adapters (before a turn opens): drop the
        caches of agents unloaded (or loaded again since), add empty ones for agents added
        (:meth:`add_agent_cache`)."""
        for agent, uid in list(state.uids.items()):
            if self.adapter_uid.get(agent) != uid:
                self.drop_agent_cache(state, agent)
                del state.uids[agent]
                state.late.discard(agent)
        for agent, uid in self.adapter_uid.items():
            if agent not in state.uids:
                self.add_agent_cache(state, agent)
                state.uids[agent] = uid
        state.version = self.version

    def add_agent_cache(self, state: CacheState, agent: str) -> None:
        """Give ``state`` an empty cache for a newly added agent (default: none, FullShared's)."""
        return None

    def drop_agent_cache(self, state: CacheState, agent: str) -> None:
        """Drop an unloaded agent's caches from ``state``."""
        state.lr.pop(agent, None)
        store = state.full.pop(agent, None)
        if store is not None:
            store.release()

    def catch_up(
        self, state: CacheState, agent: str | None, token_ids: list[int], authors: list[str | None]
    ) -> list[RowPlan]:
        """Rows that build ``agent``'s missing caches over the trajectory ``token_ids`` (whose token t
        ``authors[t]`` processed first) before its turn's own rows
        read them (they run in the turn's first forward and count in its ``prefill_tokens``);
        default: none (the method has no per-agent cache to build, or builds it in the turn)."""
        return []

    def rebuild(
        self, state: CacheState, agent: str | None, token_ids: list[int], authors: list[str | None]
    ) -> list[RowPlan] | None:
        """Rows that rebuild the caches of an emptied ``state`` over ``token_ids[:len(authors)]`` as
        this method first wrote them (``authors[t]`` processed token t first), run in one forward
        before ``agent``'s turn opens: the engine's swap space dropped the caches
        (:mod:`precache.engine.swap_space`). With :attr:`rebuilds_by_author`, each run of tokens is
        prefilled again by its author through :meth:`plans` (the base model where the author is
        unknown or unloaded). None: the method has no exact rebuild; the trajectory starts over and
        its next turn prefills every token with its own adapter."""
        if not self.rebuilds_by_author:
            return None
        plans = []
        for start, end, author in author_runs(authors, lambda a: a in self.adapters):
            plans += self.plans(state, author, token_ids[start:end], start)
        for plan in plans:
            plan.want_logits = False
        return plans

    # -- state -------------------------------------------------------------------------------
    def new_kv_store(self, offset: int = 0) -> PagedStore:
        return PagedStore(self.pool, offset)

    def new_lr_stores(self, base: PagedStore) -> dict[str, LRView]:
        """Every agent's LR cache, in the LR columns of ``base``'s blocks."""
        return {a: LRView(base, a) for a in self.adapters}

    def new_state(self) -> CacheState:
        """An empty trajectory's caches for the loaded adapters."""
        state = self.empty_state()
        state.uids, state.version = dict(self.adapter_uid), self.version
        return state

    @abstractmethod
    def empty_state(self) -> CacheState: ...

    def adapter(self, agent: str | None) -> LoRAAdapter | None:
        return None if agent is None else self.adapters[agent]

    def lr_writes(self, state: CacheState, agents) -> list[LRWrite]:
        """LR writes for ``agents`` that are loaded and whose LR cache covers the trajectory so far
        (an agent added at run time is left out until :meth:`catch_up` fills its gap)."""
        return [
            LRWrite(state.lr[a], self.adapters[a])
            for a in agents
            if a in self.adapters and a in state.lr and a not in state.late
        ]

    # -- the turn ----------------------------------------------------------------------------
    @abstractmethod
    def cached_length(self, state: CacheState) -> int:
        """Tokens of the trajectory that have a shared cache entry."""

    def prefill_start(self, state: CacheState, agent: str | None) -> int:
        """First position the agent must prefill (default: the first token without a cache entry)."""
        return self.cached_length(state)

    def begin_turn(self, state: CacheState, agent: str | None) -> None:
        state.turn_start = self.cached_length(state)

    @abstractmethod
    def plans(self, state: CacheState, agent: str | None, token_ids: list[int], pos0: int) -> list[RowPlan]:
        """Row plans for the agent to process ``token_ids`` at positions ``[pos0, pos0 + len)`` in its turn."""

    def end_turn(self, state: CacheState, agent: str | None, trajectory: list[int]) -> list[RowPlan]:
        """Close the turn; return plans of work that runs after it (ReBaseShared LP's neutral pass).

        The full blocks of the shared caches are registered for reuse by other trajectories."""
        state.turn_start = None
        self.publish_prefix(state, trajectory)
        return []

    def view_kv(
        self, state: CacheState, agent: str | None, layer: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (after RoPE) and values ``[end, n_kv_heads, head_dim]`` the agent reads over
        positions ``[0, end)`` at ``layer``, materialised (copies): ``Kb + RoPE(s Lk B^k)``,
        ``Vb + s Lv B^v`` (DESIGN.md, Notation). For diagnostics, never on the hot path."""
        lr = state.lr.get(agent) if agent is not None else None
        return materialise_view(self.model, layer, View(state.base, 0, end, lr, self.adapter(agent)))

    def check_fits(self, state: CacheState, n_tokens: int, choices: int = 1) -> None:
        """Refuse a turn that could never fit the block pool: its trajectory reaching ``n_tokens``,
        with ``choices - 1`` more forks of the open turn each writing its own tokens (parallel
        sampling: a fork's first write copies the prompt's last, shared block).

        Raises:
            CacheCapacityError: the turn's caches need more blocks than the pool holds.
        """
        cached = self.cached_length(state)
        turn = n_tokens - cached
        need = self.pool.blocks_for(n_tokens) + self.extra_turn_blocks(turn) + self.kept_blocks(state)
        need += (choices - 1) * (self.pool.blocks_for(turn) + 1 + self.extra_turn_blocks(turn))
        what = f"a {n_tokens}-token trajectory" + (f" with {choices} choices" if choices > 1 else "")
        self.pool.check_fits(need, f"{what} under {self.name}")

    def kept_blocks(self, state: CacheState) -> int:
        """Blocks ``state`` holds beyond the trajectory's own cache between turns (default none)."""
        return 0

    def extra_turn_blocks(self, turn_tokens: int) -> int:
        """Blocks a turn of ``turn_tokens`` holds beyond the trajectory's own cache (default none)."""
        return 0

    # -- bookkeeping ---------------------------------------------------------------------------
    def truncate(self, state: CacheState, length: int) -> None:
        """Cut every cache back to ``length`` tokens (DESIGN.md fact 6). Only between turns."""
        if state.turn_start is not None:
            raise CacheIntegrityError("cannot truncate caches during an open turn")
        for store in state.stores():
            store.truncate(length)
        for chain in state.prefix.values():
            chain.truncate(length, self.pool.block_size)

    def fork_state(self, state: CacheState, length: int, open_turn: bool = False) -> CacheState:
        """A copy of ``state`` over its first ``length`` tokens that shares every block (O(1) cache
        memory; the first write to a shared block copies it). Between turns, or with ``open_turn``
        in the middle of one (parallel sampling: the fork carries the open turn's caches and its
        start, so its turn goes on exactly as the parent's would).

        Raises:
            CacheIntegrityError: a turn is open on ``state`` and ``open_turn`` is False.
        """
        if state.turn_start is not None and not open_turn:
            raise CacheIntegrityError("cannot fork caches during an open turn")
        if state.turn_start is None and state.uids != self.adapter_uid:
            # adapters loaded or unloaded since its last turn: an unloaded agent's LR columns are
            # gone from the pool, so bring the caches to the loaded adapters before copying them
            self.sync_state(state)
        base = state.base.fork(length) if state.base is not None else None
        lr = {a: LRView(base, a, min(v.length, length)) for a, v in state.lr.items()}
        full = {a: s.fork(length) for a, s in state.full.items()}
        turn = state.turn.fork(length) if state.turn is not None else None
        bs = self.pool.block_size
        prefix = {
            k: c.fork(min(length, self._store(state, k).length), bs)
            for k, c in state.prefix.items()
            if k in self.prefix_stores(state)
        }
        return type(state)(
            base=base,
            lr=lr,
            full=full,
            turn=turn,
            turn_start=state.turn_start,
            prefix=prefix,
            salt=state.salt,
            uids=dict(state.uids),
            late=set(state.late),
            version=state.version,
            **self.fork_extra(state, length),
        )

    def fork_extra(self, state: CacheState, length: int) -> dict:
        """Fields of a :class:`CacheState` subclass a fork carries (default: none)."""
        return {}

    # -- cross-trajectory prefix reuse ---------------------------------------------------------
    def prefix_stores(self, state: CacheState) -> dict[str, PagedStore]:
        """The caches other trajectories may reuse by token prefix, by key (default: none)."""
        return {}

    def reuse_key(self, agent: str | None) -> str | None:
        """Which of :meth:`prefix_stores` ``agent``'s turn may take published blocks into (None: none)."""
        return None

    def _store(self, state: CacheState, key: str) -> PagedStore:
        return self.prefix_stores(state)[key]

    def publish_prefix(self, state: CacheState, trajectory: list[int]) -> None:
        """Register the full committed blocks of :meth:`prefix_stores` for reuse by other trajectories."""
        if not self.prefix_caching:
            return
        for key, store in self.prefix_stores(state).items():
            publish(store, state.prefix.setdefault(key, PrefixChain(key, salt=state.salt)), trajectory)

    def reuse_prefix(self, state: CacheState, agent: str | None, token_ids: list[int]) -> int:
        """Before a turn: extend the agent's cache with published blocks of other trajectories that
        hold the same token prefix (never the last token). Returns the tokens now cached for it.

        What a reused block holds is what the method's cache definition puts there, whoever wrote
        it; the tokens it covers then count as earlier segments of this turn's agent (under
        ReBaseShared its view of them is base + LR, not its own exact K/V)."""
        key = self.reuse_key(agent)
        if key is not None and self.prefix_caching and state.turn_start is None:
            store = self._store(state, key)
            attach(store, state.prefix.setdefault(key, PrefixChain(key, salt=state.salt)), token_ids)
        return self.prefill_start(state, agent)

    def cache_bytes(self, state: CacheState) -> dict:
        """Bytes of the pool blocks this trajectory holds (allocated, not only committed; a block
        shared with a fork or another trajectory counts in each):
        ``{"base", "lr": {agent: bytes}, "full": {agent: bytes}, "turn", "total"}``. The LR caches
        live in the LR columns of the base blocks, so ``base + sum(lr)`` is the base blocks' size."""
        out = {
            "base": state.base.nbytes() - sum(v.nbytes() for v in state.lr.values()) if state.base else 0,
            "lr": {a: s.nbytes() for a, s in state.lr.items()},
            "full": {a: s.nbytes() for a, s in state.full.items()},
            "turn": state.turn.nbytes() if state.turn is not None else 0,
        }
        out["total"] = out["base"] + out["turn"] + sum(out["lr"].values()) + sum(out["full"].values())
        return out

    def check(self, state: CacheState) -> None:
        """Integrity between turns: every LR cache as long as the base (methods that write all agents).

        Raises:
            CacheIntegrityError: an invariant does not hold.
        """
        n = self.cached_length(state)
        for a, store in state.lr.items():
            if self.adapter_uid.get(a) != state.uids.get(a):
                continue  # unloaded since the state's last turn: dropped at its next one
            if store.length > n or (store.length != n and a not in state.late):
                raise CacheIntegrityError(
                    f"{self.name}: LR cache of '{a}' has {store.length} tokens, base has {n}"
                )


class SplitKVMethod(SharingMethod):
    """A method whose state is one base cache plus one LR cache per agent (BaseShared,
    PreLRShared, ReBaseShared): the K/V split into base + LR of DESIGN.md, Notation.

    A published base block holds the LR rows of every agent loaded when it was written, so its
    prefix hash is seeded with the adapter-set version (:attr:`CacheState.version`): after an
    adapter is added, blocks published before are not taken, and a trajectory whose LR caches lag
    (``state.late``) publishes nothing."""

    splits_kv = True

    def empty_state(self) -> CacheState:
        base = self.new_kv_store()
        return CacheState(base=base, lr=self.new_lr_stores(base))

    def cached_length(self, state: CacheState) -> int:
        return state.base.length

    @staticmethod
    def _base_key(state: CacheState) -> str:
        return f"base@{state.version}" if state.version else "base"

    def prefix_stores(self, state: CacheState) -> dict[str, PagedStore]:
        return {} if state.late else {self._base_key(state): state.base}

    def reuse_key(self, agent: str | None) -> str | None:
        return "base"

    def _store(self, state: CacheState, key: str) -> PagedStore:
        return state.base

    def reuse_prefix(self, state: CacheState, agent: str | None, token_ids: list[int]) -> int:
        before = state.base.length
        usable = self.reuse_key(agent) is not None and self.prefix_caching and state.turn_start is None
        if usable and not state.late:
            key = self._base_key(state)
            attach(state.base, state.prefix.setdefault(key, PrefixChain(key, salt=state.salt)), token_ids)
        if state.base.length > before:  # a published block holds every agent's LR rows
            for view in state.lr.values():
                view.commit(state.base.length)
        return self.prefill_start(state, agent)

    def add_agent_cache(self, state: CacheState, agent: str) -> None:
        state.lr[agent] = LRView(state.base, agent)
        if state.base.length:
            state.late.add(agent)
