"""The selective-recomputation baselines' common shape (DESIGN.md, "Selective-recomputation
baselines"), at their honest best: one full KV cache shared as under FullShared (each token written
once, by the adapter of whoever processed it first), and per agent a blended view it keeps across
its turns, as NonShared keeps each agent's own cache.

Agent c's view (``state.full["view:<c>"]``) holds what c attends to over the positions it has read:
its own turns' exact K/V and the other agents' segments as c's recompute row blended them. When c
opens a turn over ``t0`` cached tokens and its view covers ``[0, r0)``, the view is extended to
``t0`` with the shared cache's entries (by reference, block by block; the rows of a partly filled
last block are copied in place, so the extension takes no new block), and the first prefill forward
of the turn carries one extra row, the recompute row: the tokens ``[r0, t0)`` (the other agents'
segments new since c's last turn) run again with c's adapter under a
:class:`~precache.cache.rowplan.Recompute` that says which layers it writes and which tokens go on past
which layer; what it writes lands in c's view only (copy-on-write), never in the shared cache. The
turn's new tokens are written to both (they are c's own, as under FullShared) and read c's view, so
at every layer they attend to the blended cache. No token-layer is recomputed twice by one agent.

Cross-trajectory prefix reuse (:mod:`precache.cache.prefix`): the shared cache's full blocks and
each agent's view's are published, the views keyed by agent and adapter load as NonShared keys its
caches; a new trajectory takes back the shared cache's blocks and the agent's own view's for its
token prefix, so a prompt an agent blended in another trajectory is not recomputed again (without
the view's blocks every agent's first turn recomputed the whole reused prefix, which NonShared
takes back from its own cache: DroidSpeak, recomputing 24 of 30 layers, then prefilled more than
NonShared, issue 36). A reused view block holds what that agent's view held over those tokens,
whoever authored them there, as a reused shared block holds its author's entries.

Prefill cost: the recompute row counts its token-layers over the layer count
(:meth:`~precache.cache.rowplan.Recompute.cost`), in the turn's ``prefill_tokens`` and its TTFT; with
rho = 1 over every layer each turn is NonShared's, and no turn prefills more than NonShared's (the
view starts where NonShared's cache of the agent starts: tests/test_selective_prefill_bound.py).
Memory: the shared cache plus each agent's view, whose blocks are the shared cache's until the
recompute row or the agent's own tokens write them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from precache.cache.pool import PagedStore
from precache.cache.prefix import PrefixChain, attach
from precache.cache.rowplan import FullWrite, Recompute, RowPlan, View
from precache.cache.views import materialise_view
from precache.methods.fullshared import FullShared
from precache.methods.state import CacheState
from precache.models.contract import LayerInput


@dataclass
class SelectiveState(CacheState):
    """:class:`CacheState` plus the trajectory's token ids as the last turn opened on them
    (``token_ids``, the recompute row's input) and the first position the open turn's recompute
    row runs (``recompute_start``: the end of the agent's view before the turn)."""

    token_ids: list[int] = field(default_factory=list)
    recompute_start: int = 0


_VIEW = "view:"
_BASE = "<base>"


def view_key(agent: str | None) -> str:
    """The key of ``agent``'s blended view in :attr:`CacheState.full` (``None``: the base model)."""
    return f"{_VIEW}{_BASE if agent is None else agent}"


def view_chain_key(agent: str | None, uid: int | None) -> str:
    """The prefix-chain key of ``agent``'s view under adapter load ``uid``: a view is reused only
    by the same load of the same adapter (as NonShared's caches are)."""
    return view_key(None) if agent is None else f"{view_key(agent)}#{uid}"


def extend_view(view: PagedStore, shared: PagedStore, end: int) -> int:
    """Extend ``view`` with ``shared``'s entries up to position ``end``; return the first position
    it did not hold before (where the recompute starts). Both stores start at position 0, so block
    ``i`` covers the same positions in each: the rows of ``view``'s partly filled last block are
    copied in place and ``shared``'s later blocks are held by reference, so this takes no new
    block (a partly filled last block shared with a fork is given up instead, and its positions
    come from ``shared`` too)."""
    pool, bs = view.pool, view.pool.block_size
    view.truncate(view.length)  # no block past the committed length
    start = view.length
    if start >= end:
        return start
    i, off = divmod(start, bs)
    if off and pool.allocator.is_shared(view.blocks[i]):
        view.truncate(i * bs)
        start, off = i * bs, 0
    if off:
        stop = min(end, (i + 1) * bs)
        dst = slice(view.blocks[i] * bs + off, view.blocks[i] * bs + off + (stop - start))
        src = shared.rows(start, stop)
        pool.k[:, dst] = pool.k[:, src]
        pool.v[:, dst] = pool.v[:, src]
        i += 1
    for block in shared.blocks[i : pool.blocks_for(end)]:
        pool.allocator.hold(block)
        view.blocks.append(block)
    view.commit(end)
    return start


def take_back_partial_block(store: PagedStore, chain: PrefixChain, token_ids: list[int]) -> None:
    """Let :func:`~precache.cache.prefix.attach` go on from a committed length inside a block: the
    store's partly filled last block gives way to the block published for the same token prefix
    (same tokens, whose entries there are the publisher's, as any reused block's are), when that
    block is not the one holding the last token. Between turns only. Without it, the turn after a
    turn whose tokens a sibling trajectory also generated prefills the block's last tokens that
    NonShared takes back from the agent's own published cache."""
    bs, alloc = store.pool.block_size, store.pool.allocator
    k, filled = divmod(store.length - store.offset, bs)
    if store.offset or not filled or len(store.blocks) != k + 1 or k >= (len(token_ids) - 1) // bs:
        return
    block = alloc.lookup(chain.extend(token_ids, k + 1, bs)[k])
    if block is None:
        return
    alloc.hold(block)  # before the release: the partial block may be the published one itself
    alloc.release(store.blocks[k])
    store.blocks[k] = block
    store.commit((k + 1) * bs)


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

    def empty_state(self) -> SelectiveState:
        return SelectiveState(full={"shared": self.new_kv_store()})

    def fork_extra(self, state: SelectiveState, length: int) -> dict:
        return {"token_ids": state.token_ids[:length], "recompute_start": min(state.recompute_start, length)}

    def prefix_stores(self, state: SelectiveState) -> dict[str, PagedStore]:
        """The shared cache under ``"shared"`` and each agent's view under :func:`view_chain_key`."""
        out = {"shared": state.full["shared"]}
        for key, store in state.full.items():
            if key.startswith(_VIEW):
                agent = key.removeprefix(_VIEW)
                agent = None if agent == _BASE else agent
                out[view_chain_key(agent, state.uids.get(agent))] = store
        return out

    def reuse_prefix(self, state: SelectiveState, agent: str | None, token_ids: list[int]) -> int:
        """As :meth:`SharingMethod.reuse_prefix` for the shared cache, then the agent's view takes
        back its own published blocks for the same token prefix, never past the shared cache (the
        recompute row then starts where they end). Also records the trajectory's token ids, which
        the turn's recompute row re-reads (the turn protocol opens every turn through here)."""
        state.token_ids = list(token_ids)
        shared, usable = state.full["shared"], self.prefix_caching and state.turn_start is None
        if usable:
            chain = state.prefix.setdefault("shared", PrefixChain("shared", salt=state.salt))
            take_back_partial_block(shared, chain, token_ids)
        start = super().reuse_prefix(state, agent, token_ids)
        if usable:
            view = state.full.setdefault(view_key(agent), self.new_kv_store())
            key = view_chain_key(agent, self.adapter_uid.get(agent))
            attach(view, state.prefix.setdefault(key, PrefixChain(key, salt=state.salt)), token_ids)
            view.truncate(shared.length)
        return start

    def check_fits(self, state: CacheState, n_tokens: int, choices: int = 1) -> None:
        """Refuse a turn that could never fit: the shared cache and the agent's view over the
        trajectory (one more block: a copy-on-write of the last shared one), the blocks the other
        agents' views hold apart from the shared cache (the largest is taken as the agent's own),
        and each further choice's writes to both.

        Raises:
            CacheCapacityError: they need more blocks than the pool holds.
        """
        shared = set(state.full["shared"].blocks)
        private = [len(set(s.blocks) - shared) for k, s in state.full.items() if k != "shared"]
        need = 2 * self.pool.blocks_for(n_tokens) + 1 + sum(private) - max(private, default=0)
        turn = n_tokens - self.cached_length(state)
        need += (choices - 1) * 2 * (self.pool.blocks_for(turn) + 1)  # each fork writes both
        what = f"a {n_tokens}-token trajectory" + (f" with {choices} choices" if choices > 1 else "")
        self.pool.check_fits(need, f"{what} under {self.name}")

    def begin_turn(self, state: SelectiveState, agent: str | None) -> None:
        super().begin_turn(state, agent)
        view = state.full.setdefault(view_key(agent), self.new_kv_store())
        state.recompute_start = extend_view(view, state.full["shared"], state.turn_start)

    def drop_agent_cache(self, state: CacheState, agent: str) -> None:
        super().drop_agent_cache(state, agent)
        view = state.full.pop(view_key(agent), None)
        if view is not None:
            view.release()

    def view_kv(self, state, agent, layer, end):
        view = state.full.get(view_key(agent))  # an agent's view covers what it has read
        if view is None:
            return materialise_view(self.model, layer, View(state.full["shared"], 0, 0))
        return materialise_view(self.model, layer, View(view, 0, min(end, view.length)))

    def recompute(self, state: SelectiveState, agent: str | None, n: int) -> Recompute | None:
        """What the recompute row does over ``n`` reused tokens (None: nothing)."""
        raise NotImplementedError

    def plans(self, state, agent, token_ids, pos0):
        shared, view = state.full["shared"], state.full[view_key(agent)]
        end, adapter = pos0 + len(token_ids), self.adapter(agent)
        out = [RowPlan(token_ids, pos0, adapter, [FullWrite(shared), FullWrite(view)], [View(view, 0, end)])]
        t0, r0 = state.turn_start, state.recompute_start
        if pos0 == t0 > r0:  # the turn's first prefill chunk (plans may be asked again before it runs)
            rc = self.recompute(state, agent, t0 - r0)
            if rc is not None:
                reused = state.token_ids[r0:t0]
                views = [View(view, 0, t0)]
                out.append(
                    RowPlan(reused, r0, adapter, [FullWrite(view)], views, want_logits=False, recompute=rc)
                )
        return out


def kept_tokens(rho: float, n: int) -> int:
    """``ceil(rho n)``, at least one token."""
    return max(1, math.ceil(rho * n))
