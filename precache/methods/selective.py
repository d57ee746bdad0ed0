"""The selective-recomputation baselines' common shape (DESIGN.md, "Selective-recomputation
baselines"): one full KV cache shared as under FullShared (each token written once, by the
adapter of whoever processed it first), and per turn a blended view for the current agent.

When agent c opens a turn over ``t0`` cached tokens, its view is a copy-on-write fork of the shared
cache (``state.turn``: a reference per block until written). The first prefill forward of the turn
carries one extra row, the recompute row: the reused tokens ``[0, t0)`` run again with c's adapter
under a :class:`~precache.cache.plan.Recompute` that says which layers it writes and which tokens
go on past which layer; what it writes lands in c's view only, never in the shared cache. The
turn's new tokens are written to both (they are c's own, as under FullShared) and read c's view, so
at every layer they attend to the blended cache. The view is dropped when the turn ends.

Prefill cost: the recompute row counts its token-layers over the layer count
(:meth:`~precache.cache.plan.Recompute.cost`), in the turn's ``prefill_tokens`` and its TTFT.
Memory: during a turn the blocks the recompute row writes are copied (at most one more cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from precache.cache.rowplan import FullWrite, Recompute, RowPlan, View
from precache.cache.views import materialise_view
from precache.methods.base import CacheState
from precache.methods.fullshared import FullShared
from precache.models.contract import LayerInput


@dataclass
class SelectiveState(CacheState):
    """:class:`CacheState` plus the trajectory's token ids as the last turn opened on them
    (``token_ids``, the recompute row's input)."""

    token_ids: list[int] = field(default_factory=list)


def check_fraction(rho: float, what: str = "rho") -> float:
    """``rho`` as a float in ``(0, 1]``.

    Raises:
        ValueError: ``rho`` is not a number in ``(0, 1]``.
    """
    if isinstance(rho, bool) or not isinstance(rho, int | float) or not 0 < rho <= 1:
        raise ValueError(f"{what} must be a fraction in (0, 1], got {rho!r}")
    return float(rho)


def check_layer_range(layers, num_layers: int) -> tuple[int, int]:
    """``(first, last)`` layers, inclusive, within the model.

    Raises:
        ValueError: not two integers with ``0 <= first <= last < num_layers``.
    """
    try:
        first, last = (int(x) for x in layers)
    except (TypeError, ValueError):
        raise ValueError(f"layers must be (first, last), got {layers!r}") from None
    if not 0 <= first <= last < num_layers:
        raise ValueError(f"layers ({first}, {last}) are not within 0..{num_layers - 1}")
    return first, last


def kv_deviation(
    x: LayerInput, rows: slice, adapter, reused: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Per token ``||K - K_r||^2 + ||V - V_r||^2`` ``[n]`` (fp32) between the K/V the layer computes
    for batch rows ``rows`` with ``adapter`` and the reused cache entries ``reused`` ``[n, Hkv, D]``."""
    k, v = x.adapted_kv(rows, adapter)
    dk = (k.float() - reused[0].float()).pow(2).flatten(1).sum(1)
    dv = (v.float() - reused[1].float()).pow(2).flatten(1).sum(1)
    return dk + dv


def top_deviations(
    x: LayerInput, rows: slice, positions: list[int], adapter, shared, kept: int
) -> torch.Tensor:
    """Row-local indices of the ``kept`` tokens whose K/V at this layer deviate most from the
    shared cache's entries (the recompute row writes only the agent's view, so the shared cache
    still holds the reused ones)."""
    first, last = positions[0], positions[-1] + 1
    if last - first != len(positions):
        raise ValueError("a deviation selection runs over a contiguous range of tokens")
    reused = shared.kv(x.layer, first, last)
    return torch.topk(kv_deviation(x, rows, adapter, reused), kept).indices


class SelectiveRecompute(FullShared):
    """Base class of CacheBlend, DroidSpeak and RelayCaching: a subclass says what the recompute
    row does (:meth:`recompute`) over ``n`` reused tokens; None skips it."""

    turn_local_view = True

    def empty_state(self) -> SelectiveState:
        return SelectiveState(full={"shared": self.new_kv_store()})

    def fork_extra(self, state: SelectiveState, length: int) -> dict:
        return {"token_ids": state.token_ids[:length]}

    def reuse_prefix(self, state: SelectiveState, agent: str | None, token_ids: list[int]) -> int:
        """As :meth:`SharingMethod.reuse_prefix`; also records the trajectory's token ids, which the
        turn's recompute row re-reads (the turn protocol opens every turn through here)."""
        state.token_ids = list(token_ids)
        return super().reuse_prefix(state, agent, token_ids)

    def check_fits(self, state: CacheState, n_tokens: int, choices: int = 1) -> None:
        need = 2 * self.pool.blocks_for(n_tokens) + 1  # the shared cache and the agent's blended view
        turn = n_tokens - self.cached_length(state)
        need += (choices - 1) * 2 * (self.pool.blocks_for(turn) + 1)  # each fork writes both
        what = f"a {n_tokens}-token trajectory" + (f" with {choices} choices" if choices > 1 else "")
        self.pool.check_fits(need, f"{what} under {self.name}")

    def begin_turn(self, state: SelectiveState, agent: str | None) -> None:
        super().begin_turn(state, agent)
        state.turn = state.full["shared"].fork()

    def end_turn(self, state: SelectiveState, agent: str | None, trajectory: list[int]) -> list[RowPlan]:
        state.turn.release()
        state.turn = None
        return super().end_turn(state, agent, trajectory)

    def view_kv(self, state, agent, layer, end):
        store = state.turn if state.turn is not None else state.full["shared"]
        return materialise_view(self.model, layer, View(store, 0, min(end, store.length)))

    def recompute(self, state: SelectiveState, agent: str | None, n: int) -> Recompute | None:
        """What the recompute row does over the ``n`` reused tokens ``[0, n)`` (None: nothing)."""
        raise NotImplementedError

    def plans(self, state, agent, token_ids, pos0):
        shared, view = state.full["shared"], state.turn
        end, adapter = pos0 + len(token_ids), self.adapter(agent)
        out = [RowPlan(token_ids, pos0, adapter, [FullWrite(shared), FullWrite(view)], [View(view, 0, end)])]
        t0 = state.turn_start
        if pos0 == t0 > 0:  # the turn's first prefill chunk (plans may be asked again before it runs)
            rc = self.recompute(state, agent, t0)
            if rc is not None:
                reused = state.token_ids[:t0]
                views = [View(view, 0, t0)]
                out.append(
                    RowPlan(reused, 0, adapter, [FullWrite(view)], views, want_logits=False, recompute=rc)
                )
        return out


def kept_tokens(rho: float, n: int) -> int:
    """``ceil(rho n)``, at least one token."""
    return max(1, math.ceil(rho * n))
