"""The PReCache paper's Figure 2 diagnostic on recorded trajectories (``precache study``): per
layer and agent transition, the shared base cache a method hands the current agent against the
one it would build from its own adapted hidden states, and the hidden-state errors that explain it.

The hidden states come from dense teacher-forced forwards with one adapter per row
(:class:`~precache.models.dense.DenseAttention`), not from the engine's caches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from precache.models import Row
from precache.models.dense import DenseAttention

# Figure 2: the method whose shared cache is compared, and which forward wrote it (see transition_errors)
FIGURE2_SOURCES = {"fullshared": "previous_full", "prelrshared": "previous", "rebaseshared": "neutral"}


class _Capture(DenseAttention):
    """Dense attention that hands ``on_layer`` each layer's ``h`` and base and adapted K/V per row."""

    def __init__(self, rows: list[Row], on_layer: Callable[[list[dict]], None]):
        super().__init__(rows)
        self.on_layer = on_layer

    def attend(self, x):
        kb, vb = x.base_kv()
        per_row = []
        for row in self.rows:
            k, v = x.adapted_kv(row.slice, row.adapter)
            per_row.append({"h": x.h[row.slice], "kb": kb[row.slice], "vb": vb[row.slice], "k": k, "v": v})
        self.on_layer(per_row)
        return super().attend(x)


def capture_states(
    model, token_ids: list[int], adapters: list, on_layer: Callable[[list[dict]], None]
) -> None:
    """Teacher-forced dense forwards of ``token_ids`` (positions from 0), one row per adapter
    (None: the base model) in one batch; ``on_layer(per_row)`` is called at every layer in order
    with one dict per row: ``h`` ``[n, hidden]`` (attention input after the input RMSNorm,
    DESIGN.md ``h_l``), ``kb`` / ``vb`` the base K (after RoPE) / V ``h W_k``, ``h W_v``
    ``[n, n_kv_heads, head_dim]``, ``k`` / ``v`` the adapted ones. Nothing is kept past the
    call, so a long trajectory costs one layer's states at a time."""
    n = len(token_ids)
    rows = [Row(i * n, (i + 1) * n, adapter) for i, adapter in enumerate(adapters)]
    ids = torch.tensor(token_ids * len(adapters), device=model.device)
    positions = torch.arange(n, device=model.device).repeat(len(adapters))
    model.forward(ids, positions, rows, _Capture(rows, on_layer))


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    norm = ref.double().norm()
    return float((a.double() - ref.double()).norm() / norm) if norm > 0 else 0.0


def transition_errors(model, token_ids: list[int], previous, current) -> dict:
    """The PReCache paper's Figure 2 quantities for one agent transition ``previous -> current``
    (adapters; None = base model) over the shared positions ``token_ids``, per layer l:

    - ``k_base_error[method][l] = ||K_method - K_own||_F / ||K_own||_F`` (likewise ``v_base_error``),
      ``K_own = RoPE(h^c W_k)`` the base cache ``current`` builds from its own adapted hidden
      states, ``K_method`` the shared entry the method hands it: PreLRShared ``RoPE(h^p W_k)``
      (the previous agent's adapted forward), ReBaseShared ``RoPE(h^0 W_k)`` (adapter-free),
      FullShared the previous agent's full cache ``RoPE(h^p (W_k + s A_p B_p))``, compared with
      ``current``'s own full cache (the two base caches when no adapter has k_proj / v_proj).
    - ``hidden_error["neutral"][l] = ||h^0 - h^c|| / ||h^c||`` and ``["previous"][l] =
      ||h^p - h^c|| / ||h^c||``: the neutral base is the closer one exactly where the first is
      smaller (the paper's appendix condition).

    All positions are teacher-forced densely with one adapter per row (:func:`capture_states`).
    """
    own, prev, neutral = 0, 1, 2
    sources = {"previous": (prev, "b"), "neutral": (neutral, "b"), "previous_full": (prev, "")}
    out = {
        "k_base_error": {m: [] for m in FIGURE2_SOURCES},
        "v_base_error": {m: [] for m in FIGURE2_SOURCES},
        "hidden_error": {"neutral": [], "previous": []},
    }

    def on_layer(states: list[dict]) -> None:
        for method, source in FIGURE2_SOURCES.items():
            row, suffix = sources[source]
            for side in ("k", "v"):
                key = side + suffix
                out[f"{side}_base_error"][method].append(_relative(states[row][key], states[own][key]))
        out["hidden_error"]["neutral"].append(_relative(states[neutral]["h"], states[own]["h"]))
        out["hidden_error"]["previous"].append(_relative(states[prev]["h"], states[own]["h"]))

    capture_states(model, token_ids, [current, previous, None], on_layer)
    return out


def trajectory_transitions(model, adapters: dict, turns: list) -> list[dict]:
    """:func:`transition_errors` at every agent turn but the first of one recorded trajectory
    (a list of :class:`~precache.engine.request.Turn`): ``previous`` is the agent of the turn
    before, the shared positions are the trajectory before the turn's appended tokens. Returns
    ``[{"previous", "current", "positions", **errors}]``."""
    transitions = []
    tokens: list[int] = []
    for i, turn in enumerate(turns):
        if i > 0 and tokens:
            prev = turns[i - 1].agent
            errors = transition_errors(model, tokens, adapters.get(prev), adapters.get(turn.agent))
            transitions.append({"previous": prev, "current": turn.agent, "positions": len(tokens), **errors})
        tokens += list(turn.appended) + list(turn.token_ids)
    return transitions


def summarize_transitions(transitions: list[dict]) -> dict:
    """``{"transitions", "across", "mean", "neutral_closer_layers"}``: ``mean`` holds the means per
    layer of each error over the transitions between two different agents (``across`` of them;
    a turn after the same agent's turn is kept in ``transitions`` but left out of the means: its
    previous-agent errors are zero by construction, and the paper's Figure 2 is about hand-overs);
    ``neutral_closer_layers`` the layers where the mean ``hidden_error["neutral"]`` is below
    ``["previous"]``."""
    across = [t for t in transitions if t["previous"] != t["current"]]
    mean: dict = {}
    for group in ("k_base_error", "v_base_error", "hidden_error"):
        keys = across[0][group] if across else {}
        mean[group] = {
            key: [sum(v) / len(v) for v in zip(*(t[group][key] for t in across), strict=True)] for key in keys
        }
    hidden = mean.get("hidden_error", {})
    closer = [
        i
        for i, (a, b) in enumerate(zip(hidden.get("neutral", []), hidden.get("previous", []), strict=True))
        if a < b
    ]
    return {"transitions": transitions, "across": len(across), "mean": mean, "neutral_closer_layers": closer}


def figure2(model, adapters: dict, trajectories: list[list]) -> dict:
    """:func:`summarize_transitions` of :func:`trajectory_transitions` over every recorded
    trajectory (lists of :class:`~precache.engine.request.Turn`)."""
    return summarize_transitions(
        [t for turns in trajectories for t in trajectory_transitions(model, adapters, turns)]
    )
