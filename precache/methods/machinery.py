"""What every sharing method shares, built on its hooks (:class:`~precache.methods.base.SharingMethod`):
adapters loaded and unloaded at run time, per-agent caches brought to the loaded adapters, forks,
truncation, cross-trajectory prefix reuse, the fit check and the byte count.

A new method does not write any of this; it implements the hooks in
:mod:`precache.methods.base`, which this mixin calls (``cached_length``, ``prefix_stores``,
``reuse_key``, ``fork_extra``, ``kept_blocks``, ``extra_turn_blocks``, ``add_agent_cache``,
``drop_agent_cache``, ``adapters_changed``, ``prefill_start``). A method may extend one of these
(calling ``super()``) where its state holds more, as ReBaseOwnShared's ``truncate`` does.
"""

from __future__ import annotations

from precache.cache.pool import KVPool, LRView, PagedStore
from precache.cache.prefix import PrefixChain, attach, publish
from precache.cache.rowplan import LRWrite
from precache.errors import AdapterError, CacheIntegrityError, UnknownAdapterError
from precache.lora.adapter import LoRAAdapter
from precache.methods.sizing import check_splittable, lr_ranks
from precache.methods.state import CacheState


class MethodMachinery:
    """The shared half of every :class:`~precache.methods.base.SharingMethod`: holds the model, the
    loaded adapters by agent name (``adapters``, ``adapter_uid``: one id per load) and the block
    pool every trajectory's caches live in (``pool``, built by whoever builds the method:
    :func:`precache.methods.build_pool`). ``prefix_caching`` lets a new trajectory take back the
    blocks another one published for the same token prefix (:meth:`reuse_prefix`; off for
    benchmarks that replay one stream several times). ``agent=None`` everywhere means the base
    model with no adapter.

    Raises:
        AdapterError: a split method with a k_proj LoRA on a model with a per-head k-norm (Qwen3).
        ValueError: a split method's ``pool`` has no LR columns for an adapter (it was built for
            another method or adapter set).
    """

    def __init__(self, model, adapters: dict[str, LoRAAdapter], pool: KVPool, prefix_caching: bool = True):
        self.model, self.adapters, self.pool, self.prefix_caching = model, adapters, pool, prefix_caching
        self.adapter_uid = {a: i for i, a in enumerate(adapters)}  # one id per load of an adapter
        self._next_uid, self.version = len(adapters), 0
        for name, adapter in adapters.items():
            self._check_adapter(name, adapter)
        missing = [a for a in adapters if a not in pool.lr_cols] if self.splits_kv else []
        if missing:
            raise ValueError(
                f"the block pool has no LR columns for {', '.join(missing)}: build it for {self.name} "
                "and these adapters (precache.methods.build_pool)"
            )

    def _check_adapter(self, name: str, adapter: LoRAAdapter) -> None:
        if self.splits_kv:
            check_splittable(self.name, self.model.config, name, adapter)

    # -- adapters at run time (DESIGN.md, "Adapters loaded at run time") --------------------------
    def add_adapter(self, name: str, adapter: LoRAAdapter) -> None:
        """Register ``adapter`` as agent ``name`` (between steps). Existing trajectories get its
        caches at their next turn (:meth:`sync_state`), built as the method defines
        (``catch_up``).

        Raises:
            AdapterError: ``name`` is loaded already, or the adapter does not fit the method.
            CacheCapacityError: a split method has no free LR columns for its ranks.
        """
        if name in self.adapters:
            raise AdapterError(f"adapter '{name}' is loaded already (unload it first)")
        self._check_adapter(name, adapter)
        if self.splits_kv:
            self.pool.assign_lr(name, *lr_ranks(adapter))
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

    def sync_state(self, state: CacheState) -> None:
        """Bring ``state``'s per-agent caches to the loaded adapters (before a turn opens): drop the
        caches of agents unloaded (or loaded again since), add empty ones for agents added
        (``add_agent_cache``)."""
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

    # -- state -------------------------------------------------------------------------------
    def new_kv_store(self, offset: int = 0) -> PagedStore:
        """An empty K/V cache in the pool, its first position ``offset``."""
        return PagedStore(self.pool, offset)

    def new_lr_stores(self, base: PagedStore) -> dict[str, LRView]:
        """Every agent's LR cache, in the LR columns of ``base``'s blocks."""
        return {a: LRView(base, a) for a in self.adapters}

    def new_state(self) -> CacheState:
        """An empty trajectory's caches for the loaded adapters."""
        state = self.empty_state()
        state.uids, state.version = dict(self.adapter_uid), self.version
        return state

    def adapter(self, agent: str | None) -> LoRAAdapter | None:
        """The adapter of ``agent`` (None: the base model)."""
        return None if agent is None else self.adapters[agent]

    def lr_writes(self, state: CacheState, agents) -> list[LRWrite]:
        """LR writes for ``agents`` that are loaded and whose LR cache covers the trajectory so far
        (an agent added at run time is left out until ``catch_up`` fills its gap)."""
        return [
            LRWrite(state.lr[a], self.adapters[a])
            for a in agents
            if a in self.adapters and a in state.lr and a not in state.late
        ]

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

    # -- bookkeeping ---------------------------------------------------------------------------
    def truncate(self, state: CacheState, length: int) -> None:
        """Cut every cache back to ``length`` tokens (DESIGN.md fact 6). Only between turns.

        Raises:
            CacheIntegrityError: a turn is open.
        """
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
        bs, stores = self.pool.block_size, self.prefix_stores(state)
        prefix = {
            k: c.fork(min(length, stores[k].length), bs) for k, c in state.prefix.items() if k in stores
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

    # -- cross-trajectory prefix reuse ---------------------------------------------------------
    def publish_prefix(self, state: CacheState, trajectory: list[int]) -> None:
        """Register the full committed blocks of ``prefix_stores`` for reuse by other trajectories."""
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
        key = self.reuse_key(state, agent)
        store = (
            self.prefix_stores(state).get(key) if self.prefix_caching and state.turn_start is None else None
        )
        if store is not None:
            before = store.length
            attach(store, state.prefix.setdefault(key, PrefixChain(key, salt=state.salt)), token_ids)
            if store.length > before:  # a published base block holds the LR rows of every agent
                for view in state.lr.values():
                    if view.store is store:
                        view.commit(store.length)
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
