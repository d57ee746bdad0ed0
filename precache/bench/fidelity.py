"""Fidelity of a sharing method against NonShared on the same trajectories, teacher-forced.

A trajectory is a list of engine :class:`~precache.engine.request.Turn` records (``appended``:
tokens appended before the turn, ``token_ids``: tokens the agent generated), recorded once under
NonShared. Every method then replays it in lockstep with a
NonShared reference session: the same tokens are appended and each agent turn is teacher-forced
through the recorded tokens, so every method sees the same context and its next-token
distribution can be compared position by position. Per agent turn:

- ``first_kl``: KL(P_NonShared || P_method) in nats at the turn's first generated position, and
  ``mean_kl`` over all its generated positions; ``first_top1`` / ``top1``: argmax agreement.
- ``k_error[l]`` / ``v_error[l]`` (the PReCache paper's Figure 2 diagnostic, in our terms): at
  layer l, ``||K_view - K_own||_F / ||K_own||_F`` over the positions ``[0, s)`` that some forward
  had processed before the turn (the earlier segments, the agent's own included). ``K_own`` is
  the agent's own full KV cache in the NonShared reference (every token read with its own
  adapter); ``K_view`` is the keys the method lets the agent attend to there: its full cache
  (NonShared, FullShared), its blended view (the selective-recompute methods), its own earlier
  turns' K/V and elsewhere the base plus its LR part (ReBaseOwnShared), or the shared base plus its
  RoPE'd LoRA part ``Kb + RoPE(s Lk_a B_a^k)`` (DESIGN.md, Notation); likewise
  ``V_view = Vb + s Lv_a B_a^v``. Measured after the turn, since entries before ``s`` never change
  during it. None on a turn with ``s = 0``.
- ``kv_bytes``: :func:`held_bytes` of the method's session after the turn.
- ``k_error_own[l]`` / ``k_error_other[l]`` (likewise ``v_``): the same error over the earlier
  positions the turn's agent wrote itself (the segments of its own earlier turns: their appended
  and generated tokens) and over the positions the other agents wrote; None where there are none.
  The PReCache paper's Figure 2 compares only the second kind; PreLRShared's base on the agent's
  own segments comes from its own adapted hidden states, ReBaseShared's never does.
"""

from __future__ import annotations

import torch

from precache.engine.request import Turn

REFERENCE = "nonshared"


def forced_turn(session, agent: str, token_ids: list[int]) -> torch.Tensor:
    """Run ``agent``'s turn on ``session`` generating exactly ``token_ids``; return the logits
    ``[len(token_ids), vocab]`` (fp32) each of them was predicted from (:meth:`Session.teacher_force`).

    Raises:
        EmptyRequestError: ``token_ids`` is empty.
    """
    return session.teacher_force(agent, token_ids).logits


def agent_kv(session, agent: str, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (after RoPE) and values ``[end, n_kv_heads, head_dim]`` that ``agent`` attends to
    over positions ``[0, end)`` at ``layer``, materialised from the session's caches."""
    return session.method.view_kv(session.state, agent, layer, end)


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    norm = ref.double().norm()
    return float((a.double() - ref.double()).norm() / norm) if norm > 0 else 0.0


def split_layer_errors(
    reference, session, agent: str, end: int, parts: dict[str, torch.Tensor | None]
) -> dict[str, tuple[list[float], list[float]]]:
    """Per-layer relative Frobenius error of ``session``'s K and V view against ``reference``'s
    (NonShared) own cache of ``agent`` over ``[0, end)``, for each of several position masks
    (``parts``: name -> a bool mask ``[end]``, or None for every position), each layer's views
    materialised once: ``{name: (k errors, v errors)}``, each list ``num_layers`` floats."""
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in parts}
    for layer in range(reference.engine.model.config.num_layers):
        k_ref, v_ref = agent_kv(reference, agent, layer, end)
        k, v = agent_kv(session, agent, layer, end)
        for name, mask in parts.items():
            sel = slice(None) if mask is None else mask
            out[name][0].append(_relative(k[sel], k_ref[sel]))
            out[name][1].append(_relative(v[sel], v_ref[sel]))
    return out


def kl_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[list[float], list[bool]]:
    """Per position: KL(softmax(ref) || softmax(logits)) in nats (float64) and argmax agreement.

    ``ref_logits``, ``logits``: ``[n, vocab]``.
    """
    p = torch.log_softmax(ref_logits.double(), dim=-1)
    q = torch.log_softmax(logits.double(), dim=-1)
    kl = (p.exp() * (p - q)).sum(-1).clamp_min(0.0)
    same = ref_logits.argmax(-1) == logits.argmax(-1)
    return kl.tolist(), same.tolist()


def _turn_record(
    reference,
    session,
    turn: Turn,
    ref_logits,
    logits,
    processed: int,
    writers: list[str | None],
    errors: bool = True,
) -> dict:
    kl, same = kl_top1(ref_logits, logits)
    record = {
        "agent": turn.agent,
        "position": processed,
        "tokens": len(turn.token_ids),
        "first_kl": kl[0],
        "mean_kl": sum(kl) / len(kl),
        "first_top1": float(same[0]),
        "top1": sum(same) / len(same),
        **{f"{side}_error{part}": None for side in "kv" for part in ("", "_own", "_other")},
    }
    if processed > 0 and errors:
        own = torch.tensor([w == turn.agent for w in writers[:processed]])
        parts = {
            "": None,
            **{part: mask for part, mask in (("_own", own), ("_other", ~own)) if bool(mask.any())},
        }
        for part, (k_err, v_err) in split_layer_errors(
            reference, session, turn.agent, processed, parts
        ).items():
            record[f"k_error{part}"], record[f"v_error{part}"] = k_err, v_err
    return record


def held_bytes(session) -> int:
    """Bytes of the distinct pool blocks ``session``'s caches hold (a block two of its stores share,
    as a selective method's view shares the shared cache's, counts once; the LR caches live in the
    base blocks)."""
    blocks = {b for store in session.state.paged_stores() for b in store.blocks}
    return len(blocks) * session.method.pool.block_bytes


def compare_trajectory(
    engines: dict, turns: list[Turn], reference: str = REFERENCE, errors: set[str] | None = None
) -> dict[str, list[dict]]:
    """Teacher-force ``turns`` on a fresh session of every engine in ``engines`` (by method name)
    in lockstep with a separate reference session of ``engines[reference]``.

    Returns ``{method: [per-turn record]}`` with the fields of the module docstring plus
    ``agent``, ``position`` (tokens processed before the turn) and ``tokens`` (generated). The
    cache errors are measured for the methods in ``errors`` only (default: every one; None
    elsewhere): materialising every layer's views is most of a replay's cost.

    Raises:
        KeyError: ``reference`` is not among ``engines``.
    """
    ref = engines[reference].session()
    sessions = {name: engine.session() for name, engine in engines.items()}
    out: dict[str, list[dict]] = {name: [] for name in engines}
    writers: list[str | None] = []  # per position: the agent of the turn that brought it in
    for turn in turns:
        processed = len(ref.authors)
        ref.append(list(turn.appended))
        ref_logits = forced_turn(ref, turn.agent, turn.token_ids)
        for name, session in sessions.items():
            session.append(list(turn.appended))
            logits = forced_turn(session, turn.agent, turn.token_ids)
            measured = errors is None or name in errors
            record = _turn_record(ref, session, turn, ref_logits, logits, processed, writers, measured)
            record["kv_bytes"] = held_bytes(session)
            out[name].append(record)
        writers += [turn.agent] * (len(turn.appended) + len(turn.token_ids))
    return out
