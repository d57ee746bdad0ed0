"""The interface a sharing method implements: what a method author reads.

A method answers three questions for the session (DESIGN.md, "The sharing methods"): where the
current agent's prefill starts (:meth:`SharingMethod.prefill_start`), which hidden states feed
which cache entries and which view each row reads (:meth:`SharingMethod.plans`), and what runs
after the turn (:meth:`SharingMethod.end_turn`). It never touches the model code.

To add a method: a module in ``precache/methods/`` with a subclass of :class:`SharingMethod` (or of
:class:`~precache.methods.split.SplitKVMethod`, for a base cache plus per-agent LR caches) that
sets :attr:`~SharingMethod.name` and implements the three required hooks
(:meth:`~SharingMethod.empty_state`, :meth:`~SharingMethod.cached_length`,
:meth:`~SharingMethod.plans`), overriding the optional ones below where its caches differ; then
one line in ``METHOD_REGISTRY`` (``precache/methods/__init__.py``). Everything else (adapters at
run time, forks, truncation, prefix reuse, the fit check, byte counts) is the shared machinery
of :mod:`precache.methods.machinery`, which calls these hooks.

Contract: a method's caches live in blocks of the pool it is handed (``self.pool``;
``self.new_kv_store()`` makes a cache, ``self.new_lr_stores(base)`` the agents' LR caches over a
base cache's blocks); between turns every cache of a :class:`CacheState` is committed up to where
the method says (:meth:`~SharingMethod.check` states it), and a row plan reads only positions some
earlier plan wrote.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from precache.cache.rowplan import RowPlan, View
from precache.cache.views import materialise_view
from precache.errors import CacheIntegrityError
from precache.methods.machinery import MethodMachinery
from precache.methods.state import CacheState, author_runs


class SharingMethod(MethodMachinery, ABC):
    """A sharing method: how the agents of one trajectory share its KV caches.

    ``SharingMethod(model, adapters, pool, prefix_caching=True)``: the model, the loaded adapters
    by agent name, and the block pool, built for this method and these adapters
    (:func:`precache.methods.build_pool`; the engine builds it); the constructor and everything
    not listed here is :class:`~precache.methods.machinery.MethodMachinery`.

    Class attributes: :attr:`name` (the registry's name); :attr:`splits_kv` (the caches split K/V
    into base + LR, so the pool reserves each agent's LR columns); :attr:`rebuilds_by_author`
    (:meth:`plans` of a token's author writes every cache entry of it, so :meth:`rebuild` can
    replay them).

    Required hooks: :meth:`empty_state`, :meth:`cached_length`, :meth:`plans`. Optional hooks, each
    with a default that fits a method keeping one cache for all agents: the turn
    (:meth:`prefill_start`, :meth:`begin_turn`, :meth:`end_turn`), adapters at run time
    (:meth:`adapters_changed`, :meth:`add_agent_cache`, :meth:`drop_agent_cache`,
    :meth:`catch_up`, :meth:`rebuild`), prefix reuse (:meth:`prefix_stores`, :meth:`reuse_key`),
    forks (:meth:`fork_extra`), room (:meth:`kept_blocks`, :meth:`extra_turn_blocks`) and checks
    (:meth:`view_kv`, :meth:`check`).
    """

    name: ClassVar[str]
    #: :meth:`plans` of a token's author writes every cache entry of it (:meth:`rebuild` replays them)
    rebuilds_by_author: ClassVar[bool] = False
    #: methods that split K/V into base + LR cannot do so under Qwen3's per-head k-norm
    splits_kv: ClassVar[bool] = False

    # -- required ------------------------------------------------------------------------------
    @abstractmethod
    def empty_state(self) -> CacheState:
        """The caches of a trajectory with no token yet (:meth:`new_state` adds the adapter ids)."""

    @abstractmethod
    def cached_length(self, state: CacheState) -> int:
        """Tokens of the trajectory that have a shared cache entry."""

    @abstractmethod
    def plans(self, state: CacheState, agent: str | None, token_ids: list[int], pos0: int) -> list[RowPlan]:
        """Row plans for the agent to process ``token_ids`` at positions ``[pos0, pos0 + len)`` in
        its turn: which hidden states write which caches, which view each row reads
        (:mod:`precache.cache.rowplan`). Called for each prefill chunk and decode step."""

    # -- the turn ------------------------------------------------------------------------------
    def prefill_start(self, state: CacheState, agent: str | None) -> int:
        """First position the agent must prefill (default: the first token without a cache entry)."""
        return self.cached_length(state)

    def begin_turn(self, state: CacheState, agent: str | None) -> None:
        """Open the agent's turn (default: record where it starts)."""
        state.turn_start = self.cached_length(state)

    def end_turn(self, state: CacheState, agent: str | None, trajectory: list[int]) -> list[RowPlan]:
        """Close the turn; return plans of work that runs after it (ReBaseShared LP's neutral pass).

        The full blocks of the shared caches are registered for reuse by other trajectories."""
        state.turn_start = None
        self.publish_prefix(state, trajectory)
        return []

    # -- adapters at run time (DESIGN.md, "Adapters loaded at run time") ---------------------------
    def adapters_changed(self) -> None:
        """Called after an adapter is added or removed (default: nothing)."""
        return None

    def add_agent_cache(self, state: CacheState, agent: str) -> None:
        """Give ``state`` an empty cache for a newly added agent (default: none, FullShared's)."""
        return None

    def drop_agent_cache(self, state: CacheState, agent: str) -> None:
        """Drop an unloaded agent's caches from ``state`` (default: its LR and full caches)."""
        state.lr.pop(agent, None)
        store = state.full.pop(agent, None)
        if store is not None:
            store.release()

    def catch_up(
        self, state: CacheState, agent: str | None, token_ids: list[int], authors: list[str | None]
    ) -> list[RowPlan]:
        """Rows that build ``agent``'s missing caches over the trajectory ``token_ids`` (whose token t
        ``authors[t]`` processed first) before its turn's own rows read them (they run in the
        turn's first forward and count in its ``prefill_tokens``); default: none (the method has no
        per-agent cache to build, or builds it in the turn)."""
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

    # -- prefix reuse and forks ----------------------------------------------------------------
    def prefix_stores(self, state: CacheState) -> dict:
        """The caches (:class:`~precache.cache.pool.PagedStore`) other trajectories may reuse by
        token prefix, by key (default: none)."""
        return {}

    def reuse_key(self, state: CacheState, agent: str | None) -> str | None:
        """Which of :meth:`prefix_stores` ``agent``'s turn may take published blocks into (None, or
        a key ``prefix_stores(state)`` does not hold now: none)."""
        return None

    def fork_extra(self, state: CacheState, length: int) -> dict:
        """Fields of a :class:`CacheState` subclass a fork carries (default: none)."""
        return {}

    # -- room in the pool ----------------------------------------------------------------------
    def kept_blocks(self, state: CacheState) -> int:
        """Blocks ``state`` holds beyond the trajectory's own cache between turns (default none)."""
        return 0

    def extra_turn_blocks(self, turn_tokens: int) -> int:
        """Blocks a turn of ``turn_tokens`` holds beyond the trajectory's own cache (default none)."""
        return 0

    # -- checks --------------------------------------------------------------------------------
    def view_kv(
        self, state: CacheState, agent: str | None, layer: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (after RoPE) and values ``[end, n_kv_heads, head_dim]`` the agent reads over
        positions ``[0, end)`` at ``layer``, materialised (copies): ``Kb + RoPE(s Lk B^k)``,
        ``Vb + s Lv B^v`` (DESIGN.md, Notation). For diagnostics, never on the hot path."""
        lr = state.lr.get(agent) if agent is not None else None
        return materialise_view(self.model, layer, View(state.base, 0, end, lr, self.adapter(agent)))

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
