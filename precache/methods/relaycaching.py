"""RelayCaching-style recomputation (Geng et al., "RelayCaching: Accelerating LLM Collaboration via
Decoding KV Cache Reuse", arXiv 2603.13289), as a baseline on the shared cache.

The paper's premise: an agent reuses the KV cache that the previous agents wrote while decoding
their outputs; the deviation of that cache from the one the next agent would compute is sparse
and concentrated in a limited range of layers and token positions, so recomputing those positions
in those layers recovers the accuracy. Only the abstract was available to us, not the section with
the exact selection rule, so this implements the rule as our design states it (DESIGN.md,
"Selective-recomputation baselines"): per turn of agent c over ``n`` reused tokens of the shared
cache (whose entries each author wrote with its own adapter while prefilling or decoding them;
:mod:`precache.methods.selective`), the reused tokens run with c's adapter through layers
``0 .. first``, writing nothing before ``first``; at layer ``first`` every token's K/V is written
and the ``ceil(rho n)`` positions with the largest ``||K - K_r||^2 + ||V - V_r||^2`` against the
reused entries go on, rewriting theirs through layer ``last``; above ``last`` every token keeps
the reused entries. Defaults: ``rho = 0.15`` and the layer range ``(1, ceil(L / 2) - 1)``, the
first half of the network without its embedding-adjacent layer.

Cost per turn: ``n (first + 1) + ceil(rho n) (last - first)`` token-layers (``prefill_tokens``
counts them over ``L``, rounded up). With ``rho = 1`` and the range ``(0, L - 1)`` this is the
agent's own forward: NonShared for that turn.
"""

from __future__ import annotations

import math

from precache.cache.rowplan import Recompute
from precache.methods.selective import (
    SelectiveRecompute,
    check_fraction,
    check_layer_range,
    kept_tokens,
    top_deviations,
)

DEFAULT_RHO = 0.15


class RelayCaching(SelectiveRecompute):
    """``rho``: the fraction of reused positions recomputed; ``layers``: the range ``(first, last)``
    (inclusive) they are recomputed in.

    Raises:
        ValueError: ``rho`` not in ``(0, 1]``, or ``layers`` outside the model.
    """

    name = "relaycaching"

    def __init__(
        self,
        model,
        adapters,
        pool,
        rho: float = DEFAULT_RHO,
        layers: tuple[int, int] | None = None,
        **options,
    ):
        self.rho = check_fraction(rho)
        num_layers = model.config.num_layers
        if layers is None:
            layers = (min(1, num_layers - 1), max(min(1, num_layers - 1), math.ceil(num_layers / 2) - 1))
        self.layers = check_layer_range(layers, num_layers)
        super().__init__(model, adapters, pool, **options)

    def recompute(self, state, agent, n):
        first, last = self.layers
        num_layers = self.model.config.num_layers
        if first == last:  # the selection point is the last layer: every token there, none after
            return Recompute(num_layers, first_write=first, last_layer=last)
        kept, adapter, shared = kept_tokens(self.rho, n), self.adapter(agent), state.full["shared"]

        def select(x, rows, positions):
            return top_deviations(x, rows, positions, adapter, shared, kept)

        return Recompute(
            num_layers, first_write=first, last_layer=last, select_layer=first, select=select, kept=kept
        )
