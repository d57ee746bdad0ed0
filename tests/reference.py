"""Brute-force references for the sharing-method facts (DESIGN.md): full materialised K/V, an
explicit softmax, every definition recomputed from scratch with our HF-validated forward."""

from __future__ import annotations

import math

import torch

from precache.models import LayerInput, Row


class ReferenceAttention:
    """One row at positions ``[pos0, pos0 + T)`` reading a fixed materialised prefix ``[0, pos0)``.

    ``prefix[l] = (K, V)`` ``[pos0, Hkv, D]`` is the agent's view of earlier tokens; ``reread[l]``
    (BaseShared) holds stored base K/V for the row's first tokens, to which the row adds its own
    LoRA part (DESIGN.md, BaseShared in detail). Records ``h`` per layer.
    """

    def __init__(self, adapter, prefix, reread=None):
        self.adapter, self.prefix, self.reread = adapter, prefix, reread
        self.h: list[torch.Tensor] = []

    def attend(self, x: LayerInput) -> torch.Tensor:
        self.h.append(x.h.clone())
        k, v = x.adapted_kv(slice(None), self.adapter)
        if self.reread is not None:
            kb_stored, vb_stored = self.reread[x.layer]
            n = kb_stored.shape[0]
            kb, vb = x.base_kv()
            k, v = k.clone(), v.clone()
            k[:n] = kb_stored + (k[:n] - kb[:n])
            v[:n] = vb_stored + (v[:n] - vb[:n])
        pk, pv = self.prefix[x.layer]
        keys, values = torch.cat([pk, k]), torch.cat([pv, v])  # [P + T, Hkv, D]
        T, Hq, D = x.q.shape
        G = Hq // keys.shape[1]
        keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
        scores = torch.einsum("thd,nhd->htn", x.q, keys) / math.sqrt(D)
        P = pk.shape[0]
        mask = torch.arange(P + T)[None, :] <= (P + torch.arange(T))[:, None]
        window = x.model.config.window(x.layer)  # sliding window: key p visible when p > t - window
        if window is not None:
            mask &= torch.arange(P + T)[None, :] > (P + torch.arange(T))[:, None] - window
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("htn,nhd->thd", probs, values).reshape(T, Hq * D)


def reference_run(model, token_ids, pos0, adapter, prefix, reread=None):
    """``(logits [T, vocab], h per layer [T, hidden])`` of the row under :class:`ReferenceAttention`."""
    ref = ReferenceAttention(adapter, prefix, reread)
    T = len(token_ids)
    logits = model.forward(
        torch.tensor(token_ids),
        torch.arange(pos0, pos0 + T),
        [Row(0, T, adapter)],
        ref,
        logits_at=list(range(T)),
    )
    return logits, ref.h


def base_kv(model, layer, h, cos, sin):
    """Adapter-free ``(K after RoPE, V)`` ``[n, Hkv, D]`` of attention inputs ``h`` ``[n, hidden]``
    at positions whose RoPE tables are ``cos`` / ``sin``, as the forward builds the base cache's
    entries (``model.qkv``, then ``model.finish_kv``)."""
    _, k_lin, v_lin = model.qkv(layer, h)
    return model.finish_kv(layer, k_lin, v_lin, cos, sin)


def lora_view(model, adapter, layer, k, v, lk, lv, start):
    """Materialise ``K = Kb + RoPE(s Lk B^k)``, ``V = Vb + s Lv B^v`` (DESIGN.md, Notation)."""
    k, v = k.clone(), v.clone()
    if adapter is not None and adapter.has(layer, "k_proj"):
        a_b = adapter.weights[(layer, "k_proj")][1]
        cos, sin = model.rope.span(start, start + k.shape[0])
        k += model.rope.apply((adapter.scaling * lk @ a_b).view(k.shape), cos, sin)
    if adapter is not None and adapter.has(layer, "v_proj"):
        v += (adapter.scaling * lv @ adapter.weights[(layer, "v_proj")][1]).view(v.shape)
    return k, v


def agent_view(method, state, agent, end):
    """The agent's materialised view ``[(K, V)]`` per layer of positions ``[0, end)``."""
    model = method.model
    out = []
    for layer in range(model.config.num_layers):
        if method.name == "nonshared":
            k, v = state.full["<base>" if agent is None else agent].kv(layer, 0, end)
            out.append((k.clone(), v.clone()))
        elif method.name.startswith("rebaseownshared"):  # own segments exact: the oracle is its own test
            out.append(method.view_kv(state, agent, layer, end))
        elif method.name == "fullshared":
            k, v = state.full["shared"].kv(layer, 0, end)
            out.append((k.clone(), v.clone()))
        else:
            k, v = state.base.kv(layer, 0, end)
            adapter = method.adapters.get(agent) if agent else None
            lk, lv = state.lr[agent].lr(layer, 0, end) if agent else (None, None)
            out.append(lora_view(model, adapter, layer, k, v, lk, lv, 0))
    return out
