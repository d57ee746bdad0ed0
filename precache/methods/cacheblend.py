"""CacheBlend-style selective recomputation (Yao et al., "CacheBlend: Fast Large Language Model
Serving for RAG with Cached Knowledge Fusion", EuroSys 2025), as a baseline on the shared cache.

The paper's rule (its section 4): reuse the precomputed KV cache, recompute the KV of every reused
token at the first layer(s), keep the tokens whose recomputed KV deviates most from the reused one
("high-KV-deviation" tokens, a fraction rho, about 15%), and carry only those through the later
layers, overwriting their KV there; the other tokens keep the reused entries. Here, per turn of
agent c over ``n`` reused tokens of the shared cache (:mod:`precache.methods.selective`): the
reused tokens run with c's adapter through layers ``0 .. check_layer`` (every token, every entry
written to c's view), the ``ceil(rho n)`` tokens with the largest ``||K - K_r||^2 + ||V - V_r||^2``
at ``check_layer`` (summed over heads, against the shared cache's entries) run the remaining
layers, writing theirs. The paper filters gradually over its first layers; this uses one check
layer (default 1, the paper's choice of selecting on the layer after the first).

Cost per turn: ``n (check_layer + 1) + ceil(rho n) (L - check_layer - 1)`` token-layers
(``prefill_tokens`` counts them over ``L``, rounded up). With ``rho = 1`` every reused token is
recomputed at every layer, which is the agent's own forward: NonShared for that turn.
"""

from __future__ import annotations

from precache.cache.rowplan import Recompute
from precache.methods.selective import SelectiveRecompute, check_fraction, kept_tokens, top_deviations

DEFAULT_RHO = 0.15


class CacheBlend(SelectiveRecompute):
    """``rho``: the fraction of reused tokens recomputed through the layers after ``check_layer``
    (default: layer 1, or 0 on a two-layer model).

    Raises:
        ValueError: ``rho`` not in ``(0, 1]``, or ``check_layer`` not before the model's last layer.
    """

    name = "cacheblend"

    def __init__(
        self, model, adapters, pool, rho: float = DEFAULT_RHO, check_layer: int | None = None, **options
    ):
        self.rho = check_fraction(rho)
        last = model.config.num_layers - 1
        check_layer = min(1, last - 1) if check_layer is None else check_layer
        if isinstance(check_layer, bool) or not isinstance(check_layer, int) or not 0 <= check_layer < last:
            raise ValueError(f"check_layer must be an integer in 0..{last - 1}, got {check_layer!r}")
        self.check_layer = check_layer
        super().__init__(model, adapters, pool, **options)

    def recompute(self, state, agent, n):
        kept, adapter, shared = kept_tokens(self.rho, n), self.adapter(agent), state.full["shared"]

        def select(x, rows, positions):
            return top_deviations(x, rows, positions, adapter, shared, kept)

        return Recompute(
            self.model.config.num_layers, select_layer=self.check_layer, select=select, kept=kept
        )
