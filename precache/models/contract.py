"""The contract between a model family and the cache: rows of a flattened batch, what each layer
hands to attention, and the protocols both sides implement.

``precache.cache`` imports only this module from ``precache.models``: a new model family is a new
file that builds :class:`LayerInput` s and calls a :class:`LayerAttention` at each layer; a cache
layout implements :class:`LayerAttention` (the cache's is
:class:`~precache.cache.planned_attention.PlannedAttention`) and never imports a model. (An
attention *kernel* is another interface, one level down:
:class:`precache.cache.attention.AttentionBackend`, which ``PlannedAttention`` calls.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from precache.lora.adapter import LoRAAdapter


class KVProjector(Protocol):
    """What the cache needs from a model: KV projection and RoPE hooks.

    ``finish_kv(layer, k_lin, v_lin, cos, sin)`` turns linear projections ``[n, n_kv_heads * head_dim]``
    into ``(K after k-norm and RoPE, V)`` ``[n, n_kv_heads, head_dim]``; ``rope`` has
    ``tables(positions)`` and ``apply(x, cos, sin)`` (RoFormer eq. 34); ``config`` is the
    :class:`~precache.models.config.ModelConfig`.
    """

    config: object
    rope: object
    dtype: torch.dtype
    device: torch.device

    def finish_kv(self, layer: int, k_lin, v_lin, cos, sin) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class Row:
    """One sequence of the flattened batch: tokens ``[start, end)``, run with ``adapter`` (None: base)."""

    start: int
    end: int
    adapter: LoRAAdapter | None = None

    @property
    def slice(self) -> slice:
        return slice(self.start, self.end)


@dataclass
class LayerInput:
    """What a layer hands to the attention backend.

    ``h`` ``[N, hidden]`` is the attention input (after the input RMSNorm, DESIGN.md ``h_l^m(t)``),
    ``q`` ``[N, n_heads, head_dim]`` the per-row adapted queries after RoPE, ``cos``/``sin``
    ``[N, head_dim]`` the RoPE tables at each token's position. ``k_lin``/``v_lin``
    ``[N, n_kv_heads * head_dim]`` are the adapter-free projections ``h W_k (+ b)``, ``h W_v (+ b)``
    from the fused qkv matmul.
    """

    layer: int
    h: torch.Tensor
    q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    model: KVProjector
    k_lin: torch.Tensor
    v_lin: torch.Tensor
    _base: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def base_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Adapter-free ``(K after RoPE, V)``, each ``[N, n_kv_heads, head_dim]`` (memoised)."""
        if self._base is None:
            self._base = self.model.finish_kv(self.layer, self.k_lin, self.v_lin, self.cos, self.sin)
        return self._base

    def adapted_kv(self, sl: slice, adapter: LoRAAdapter | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K after RoPE, V)`` of tokens ``sl`` with ``adapter``: the full KV-cache entries."""
        layer = self.layer
        if adapter is None or not (adapter.has(layer, "k_proj") or adapter.has(layer, "v_proj")):
            k, v = self.base_kv()
            return k[sl], v[sl]
        h, k_lin, v_lin = self.h[sl], self.k_lin[sl], self.v_lin[sl]
        if adapter.has(layer, "k_proj"):
            k_lin = k_lin + adapter.delta(h, layer, "k_proj")
        if adapter.has(layer, "v_proj"):
            v_lin = v_lin + adapter.delta(h, layer, "v_proj")
        return self.model.finish_kv(layer, k_lin, v_lin, self.cos[sl], self.sin[sl])


@dataclass(frozen=True)
class Narrowing:
    """The tokens of the batch that go on past a layer boundary (selective recomputation).

    ``keep`` ``[N']``: indices into the current batch, ascending, on the model's device; ``rows``:
    the rows over the kept tokens, in batch order. A narrowing never drops a token whose logits
    are wanted, and never moves one: such tokens sit before every dropped one.
    """

    keep: torch.Tensor
    rows: list[Row]


class LayerAttention(Protocol):
    """What a model calls at each layer: writes that layer's cache entries (if it keeps a cache) and
    returns the attention output ``[N, n_heads * head_dim]`` of every row of the batch.

    A backend may also define ``narrow(layer) -> Narrowing | None``, called after each layer's
    MLP: the model then carries only the kept tokens through the later layers (the recompute hook
    of :class:`precache.cache.rowplan.Recompute`)."""

    def attend(self, x: LayerInput) -> torch.Tensor: ...


@dataclass
class DecodeStepInputs:
    """The fixed tensors of one captured decode step (:mod:`precache.models.step_graph`), filled by
    the cache (:mod:`precache.cache.step_inputs`) from the step's row plans: ``B`` one-token rows,
    each reading ``L`` pool rows (its keys, padded to the longest row).

    Per row: ``token_ids``, ``positions`` ``[B]``; ``adapter`` ``[B]`` the row's index into the LoRA
    stacks (0: base model); ``self_full`` ``[B]`` bool: the row's own new entry is the adapted
    (full) K/V, not the base one.

    Per key: ``slots`` ``[B, L]`` pool rows; ``key_positions`` ``[B, L]``; ``key_valid`` ``[B, L]``
    bool (False at padding); ``is_self`` ``[B, L]`` bool, the key of the row's own token (written
    after the step, so the graph reads it from what it computes); ``lr_on`` ``[B, L]`` bool, True
    where the key adds the row's LR part ``RoPE(s Lk B^k)``, ``s Lv B^v``, DESIGN.md Notation).

    LR reads: ``lr_cols`` ``[B, rank_k + rank_v]`` the pool's LR columns the row reads (key then
    value columns), ``lr_adapter`` ``[B]`` the stack index of the adapter whose ``B^k``/``B^v`` lift
    them. ``stacks`` maps a projection (``q_proj`` .. ``down_proj``) to ``(A [n_adapters + 1,
    n_layers, d_in, rank], s B [n_adapters + 1, n_layers, rank, d_out])`` (index 0 and layers
    without the projection: zeros); ``lr_down`` ``[n_layers, hidden, C]``: every agent's ``A^k``/``A^v``
    in the pool's LR column order (None when the step writes and reads no LR cache).

    ``window``: one row (``B == 1``) whose keys other than its own lie in one or a few runs of
    contiguous pool rows, which the step receives as views ``[n_layers, W_r, ...]`` of the pools
    and reads in place; the keys are the runs' rows in order, then the row's own
    (:mod:`precache.models.step_attention`). ``slots`` still names every key's pool row.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    adapter: torch.Tensor
    self_full: torch.Tensor
    slots: torch.Tensor
    key_positions: torch.Tensor
    key_valid: torch.Tensor
    is_self: torch.Tensor
    lr_on: torch.Tensor
    lr_cols: torch.Tensor
    lr_adapter: torch.Tensor
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor]]
    lr_down: torch.Tensor | None
    window: bool = False


@dataclass
class DecodeStepOutputs:
    """What a captured decode step returns: ``logits`` ``[B, vocab]`` (fp32) and every layer's new
    entries, written into the pool after the step: ``k_base``/``v_base`` (adapter-free),
    ``k_full``/``v_full`` (with the row's adapter) ``[n_layers, B, n_kv_heads, head_dim]`` (keys
    after RoPE), ``lr`` ``[n_layers, B, C]`` (``h A`` of every agent's LR columns; None without LR)."""

    logits: torch.Tensor
    k_base: torch.Tensor
    v_base: torch.Tensor
    k_full: torch.Tensor
    v_full: torch.Tensor
    lr: torch.Tensor | None


@dataclass(frozen=True)
class StepWrites:
    """Where a step's new entries go: batch rows ``*_src`` ``[n]`` to pool rows ``*_dst`` ``[n]``.
    LR writes come in ``lr`` passes of ``(src, dst, mask)``, ``mask`` ``[n, C]`` the LR columns each
    fills; a pool row that several batch rows fill (ReBaseShared DB: the neutral row and the agent's
    row write different agents' columns of one position) is written once per pass."""

    base_src: torch.Tensor
    base_dst: torch.Tensor
    full_src: torch.Tensor
    full_dst: torch.Tensor
    lr: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True)
class DecodeStep:
    """One decode step as the cache hands it to the model's captured graph
    (:meth:`precache.models.step_graph.DecodeGraph.__call__`), which returns its logits
    ``[B, vocab]``: the graph's ``inputs``; the pool tensors it reads, ``reads`` = ``(k, v, lr)``
    (the pool's ``[n_layers, rows, n_kv_heads, head_dim]`` / ``[n_layers, rows, C]`` tensors, or
    for window inputs tuples of views of each run of their rows); and where its new entries go,
    ``writes`` into the pool's tensors ``pool`` = ``(k, v, lr)``, right after the graph
    (:meth:`write`)."""

    inputs: DecodeStepInputs
    reads: tuple
    writes: StepWrites
    pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def write(self, out: DecodeStepOutputs) -> None:
        """Write the step's new entries ``out`` into the pool: one indexed copy per pool tensor and
        kind of entry over every layer, cast to the pool's dtype (``kv_cache_dtype``); the graph
        itself reads the pool only."""
        k, v, lr = self.pool
        w = self.writes
        if w.base_dst.numel():
            k[:, w.base_dst] = out.k_base[:, w.base_src].to(k.dtype)
            v[:, w.base_dst] = out.v_base[:, w.base_src].to(v.dtype)
        if w.full_dst.numel():
            k[:, w.full_dst] = out.k_full[:, w.full_src].to(k.dtype)
            v[:, w.full_dst] = out.v_full[:, w.full_src].to(v.dtype)
        for src, dst, mask in w.lr:
            lr[:, dst] = torch.where(mask, out.lr[:, src].to(lr.dtype), lr[:, dst])
