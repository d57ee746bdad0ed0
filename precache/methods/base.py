"""The interface every sharing method implements, and the cache state it works on.

A method answers three questions for the session (DESIGN.md, "The sharing methods"):
where the current agent's prefill starts (:meth:`SharingMethod.prefill_start`), which hidden
states feed which cache entries and which view each row reads (:meth:`SharingMethod.plans`), and
what runs after the turn (:meth:`SharingMethod.end_turn`). It never touches the model code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from precache.cache.plan import LRWrite, RowPlan, View, view_segment
from precache.cache.store import KVStore, LRStore
from precache.errors import AdapterError, CacheIntegrityError
from precache.lora.adapter import LoRAAdapter


@dataclass
class CacheState:
    """All caches of one trajectory.

    ``base``: the shared base cache (None for NonShared); ``lr[a]``: agent a's LR cache;
    ``full[a]``: a full KV cache (NonShared: one per agent; FullShared: one under ``"shared"``);
    ``turn``: the current agent's exact adapted K/V over its own turn (ReBaseShared only);
    ``turn_start``/``turn_agent``: where and whose the open turn is (None between turns).
    """

    base: KVStore | None = None
    lr: dict[str, LRStore] = field(default_factory=dict)
    full: dict[str, KVStore] = field(default_factory=dict)
    turn: KVStore | None = None
    turn_start: int | None = None
    turn_agent: str | None = None

    def stores(self) -> list[KVStore | LRStore]:
        out = [self.base, self.turn, *self.lr.values(), *self.full.values()]
        return [s for s in out if s is not None]


class SharingMethod(ABC):
    """Base class: holds the model and the loaded adapters by agent name.

    ``agent=None`` everywhere means the base model with no adapter.
    """

    name: ClassVar[str]
    #: methods that split K/V into base + LR cannot do so under Qwen3's per-head k-norm
    splits_kv: ClassVar[bool] = False

    def __init__(self, model, adapters: dict[str, LoRAAdapter]):
        self.model, self.adapters = model, adapters
        c = model.config
        self._kv_shape = (c.num_layers, c.num_kv_heads, c.head_dim)
        if self.splits_kv and c.qk_norm:
            for name, adapter in adapters.items():
                if "k_proj" in adapter.targets:
                    raise AdapterError(
                        f"adapter '{name}' has a k_proj LoRA; under {self.name} the key is split into base + LR, "
                        f"which the per-head k-norm of {c.model_type} does not allow (use v/q/o/MLP targets)"
                    )

    # -- state -------------------------------------------------------------------------------
    def new_kv_store(self, offset: int = 0) -> KVStore:
        return KVStore(*self._kv_shape, dtype=self.model.dtype, device=self.model.device, offset=offset)

    def new_lr_stores(self) -> dict[str, LRStore]:
        out = {}
        for name, a in self.adapters.items():
            rk = a.rank if "k_proj" in a.targets else 0
            rv = a.rank if "v_proj" in a.targets else 0
            out[name] = LRStore(self.model.config.num_layers, rk, rv, self.model.dtype, self.model.device)
        return out

    @abstractmethod
    def new_state(self) -> CacheState: ...

    def adapter(self, agent: str | None) -> LoRAAdapter | None:
        return None if agent is None else self.adapters[agent]

    def lr_writes(self, state: CacheState, agents) -> list[LRWrite]:
        return [LRWrite(state.lr[a], self.adapters[a]) for a in agents]

    # -- the turn ----------------------------------------------------------------------------
    @abstractmethod
    def cached_length(self, state: CacheState) -> int:
        """Tokens of the trajectory that have a shared cache entry."""

    def prefill_start(self, state: CacheState, agent: str | None) -> int:
        """First position the agent must prefill (default: the first token without a cache entry)."""
        return self.cached_length(state)

    def begin_turn(self, state: CacheState, agent: str | None) -> None:
        state.turn_start, state.turn_agent = self.cached_length(state), agent

    @abstractmethod
    def plans(self, state: CacheState, agent: str | None, token_ids: list[int], pos0: int) -> list[RowPlan]:
        """Row plans for the agent to process ``token_ids`` at positions ``[pos0, pos0 + len)`` in its turn."""

    def end_turn(self, state: CacheState, agent: str | None, trajectory: list[int]) -> list[RowPlan]:
        """Close the turn; return plans of work that runs after it (ReBaseShared LP's neutral pass)."""
        state.turn_start = state.turn_agent = None
        return []

    def view_kv(
        self, state: CacheState, agent: str | None, layer: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (after RoPE) and values ``[end, n_kv_heads, head_dim]`` the agent reads over
        positions ``[0, end)`` at ``layer``, materialised (copies): ``Kb + RoPE(s Lk B^k)``,
        ``Vb + s Lv B^v`` (DESIGN.md, Notation). For diagnostics, never on the hot path."""
        lr = state.lr.get(agent) if agent is not None else None
        seg = view_segment(self.model, layer, View(state.base, 0, end, lr, self.adapter(agent)))
        v = seg.v if seg.lv is None else seg.v + (seg.scaling * (seg.lv @ seg.bv)).view(seg.v.shape)
        return seg.k.clone(), v.clone()

    # -- bookkeeping ---------------------------------------------------------------------------
    def truncate(self, state: CacheState, length: int) -> None:
        """Cut every cache back to ``length`` tokens (DESIGN.md fact 6). Only between turns."""
        if state.turn_start is not None:
            raise CacheIntegrityError("cannot truncate caches during an open turn")
        for store in state.stores():
            store.truncate(length)

    def cache_bytes(self, state: CacheState) -> dict:
        """Bytes held: ``{"base", "lr": {agent: bytes}, "full": {agent: bytes}, "turn", "total"}``."""
        out = {
            "base": state.base.nbytes() if state.base is not None else 0,
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
            if store.length != n:
                raise CacheIntegrityError(
                    f"{self.name}: LR cache of '{a}' has {store.length} tokens, base has {n}"
                )


class SplitKVMethod(SharingMethod):
    """A method whose state is one base cache plus one LR cache per agent (BaseShared,
    PreLRShared, ReBaseShared): the K/V split into base + LR of DESIGN.md, Notation."""

    splits_kv = True

    def new_state(self) -> CacheState:
        return CacheState(base=self.new_kv_store(), lr=self.new_lr_stores())

    def cached_length(self, state: CacheState) -> int:
        return state.base.length
