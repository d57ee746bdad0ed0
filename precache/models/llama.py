"""Our own Llama-family forward (Llama, Mistral, Qwen2, Qwen3) over a flattened, mixed-adapter batch.

The model owns no cache. Each layer hands its attention input to an :class:`AttentionBackend`
(a sharing method's cache plan, or :class:`DenseAttention` for a cache-free pass), which decides
which cache entries to write from which hidden states and which view each row attends to
(DESIGN.md, "The sharing methods"). Adding a sharing method therefore never touches this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from precache.models.config import ModelConfig
from precache.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from precache.lora.adapter import LoRAAdapter


@dataclass(frozen=True)
class Row:
    """One sequence of the flattened batch: tokens ``[start, end)``, run with ``adapter`` (None: base)."""

    start: int
    end: int
    adapter: LoRAAdapter | None = None

    @property
    def slice(self) -> slice:
        return slice(self.start, self.end)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) computed in fp32 like HF Llama: ``[..., d] -> [..., d]``."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_lora(y: torch.Tensor, x: torch.Tensor, rows: list[Row], layer: int, proj: str) -> torch.Tensor:
    """Add each row's LoRA delta ``s (x A) B`` to ``y`` in place. ``x`` ``[N, d_in]``, ``y`` ``[N, d_out]``."""
    for row in rows:
        if row.adapter is not None and row.adapter.has(layer, proj):
            y[row.slice] += row.adapter.delta(x[row.slice], layer, proj)
    return y


@dataclass
class LayerInput:
    """What a layer hands to the attention backend.

    ``h`` ``[N, hidden]`` is the attention input (after the input RMSNorm, DESIGN.md ``h_l^m(t)``),
    ``q`` ``[N, n_heads, head_dim]`` the per-row adapted queries after RoPE, ``cos``/``sin``
    ``[N, head_dim]`` the RoPE tables at each token's position.
    """

    layer: int
    h: torch.Tensor
    q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    model: LlamaModel
    _base: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def base_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Adapter-free ``(K after RoPE, V)``, each ``[N, n_kv_heads, head_dim]`` (memoised)."""
        if self._base is None:
            self._base = self.model.project_kv(self.layer, self.h, self.cos, self.sin, None, slice(None))
        return self._base

    def adapted_kv(self, sl: slice, adapter: LoRAAdapter | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K after RoPE, V)`` of tokens ``sl`` with ``adapter``: the full KV-cache entries."""
        if adapter is None or not (adapter.has(self.layer, "k_proj") or adapter.has(self.layer, "v_proj")):
            k, v = self.base_kv()
            return k[sl], v[sl]
        return self.model.project_kv(self.layer, self.h, self.cos, self.sin, adapter, sl)


class AttentionBackend(Protocol):
    """Writes cache entries for a layer and returns the attention output ``[N, n_heads * head_dim]``."""

    def attend(self, x: LayerInput) -> torch.Tensor: ...


class LlamaModel:
    """Weights plus forward. Built by :func:`precache.load_model` from an HF state dict.

    Attributes: ``config`` (:class:`ModelConfig`), ``hf_config``, ``tokenizer``, ``rope``,
    ``dtype``, ``device``, ``path`` (checkpoint folder).
    """

    def __init__(
        self, config: ModelConfig, hf_config, state: dict[str, torch.Tensor], tokenizer=None, path=""
    ):
        self.config, self.hf_config, self.tokenizer, self.path = config, hf_config, tokenizer, str(path)
        self.embed = state["model.embed_tokens.weight"]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.norm = state["model.norm.weight"]
        self.lm_head = (
            state.get("lm_head.weight", self.embed) if not config.tie_word_embeddings else self.embed
        )
        self.layers = [self._layer_weights(state, i) for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(
            hf_config, config.head_dim, config.max_position_embeddings, self.dtype, self.device
        )

    @staticmethod
    def _layer_weights(state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor | None]:
        p = f"model.layers.{i}."
        w = {
            name: state.get(p + key)
            for name, key in {
                "input_norm": "input_layernorm.weight",
                "post_norm": "post_attention_layernorm.weight",
                "q_norm": "self_attn.q_norm.weight",
                "k_norm": "self_attn.k_norm.weight",
            }.items()
        }
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w[proj] = state[f"{p}self_attn.{proj}.weight"]
            w[proj + "_bias"] = state.get(f"{p}self_attn.{proj}.bias")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w[proj] = state[f"{p}mlp.{proj}.weight"]
        return w

    @property
    def max_context(self) -> int:
        """Longest trajectory the model accepts, in tokens (``max_position_embeddings``)."""
        return self.config.max_position_embeddings

    def _linear(self, x: torch.Tensor, layer: int, proj: str, rows: list[Row]) -> torch.Tensor:
        w = self.layers[layer]
        return add_lora(F.linear(x, w[proj], w.get(proj + "_bias")), x, rows, layer, proj)

    def project_kv(self, layer, h, cos, sin, adapter, sl) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K after RoPE, V)`` ``[n, n_kv_heads, head_dim]`` of ``h[sl]`` with ``adapter`` (None: base)."""
        c, w = self.config, self.layers[layer]
        rows = [Row(0, h[sl].shape[0], adapter)]
        k = self._linear(h[sl], layer, "k_proj", rows).view(-1, c.num_kv_heads, c.head_dim)
        v = self._linear(h[sl], layer, "v_proj", rows).view(-1, c.num_kv_heads, c.head_dim)
        if w["k_norm"] is not None:
            k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
        return RotaryEmbedding.apply(k, cos[sl], sin[sl]), v

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: list[Row],
        attention: AttentionBackend,
        logits_at: list[int] | None = None,
    ) -> torch.Tensor:
        """Run the flattened batch and return logits ``[len(logits_at), vocab]`` (fp32).

        ``input_ids`` and ``positions`` are ``[N]``; ``rows`` cut them into sequences, each with its
        own adapter. ``logits_at`` indexes the tokens whose next-token logits are wanted (default:
        the last token of each row).
        """
        c = self.config
        x = self.embed[input_ids]  # [N, hidden]
        cos, sin = self.rope.tables(positions)
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["input_norm"], c.rms_norm_eps)
            q = self._linear(h, i, "q_proj", rows).view(-1, c.num_heads, c.head_dim)
            if w["q_norm"] is not None:
                q = rms_norm(q, w["q_norm"], c.rms_norm_eps)
            q = RotaryEmbedding.apply(q, cos, sin)
            attn = attention.attend(LayerInput(i, h, q, cos, sin, self))  # [N, Hq * D]
            x = x + self._linear(attn, i, "o_proj", rows)
            h2 = rms_norm(x, w["post_norm"], c.rms_norm_eps)
            gated = F.silu(self._linear(h2, i, "gate_proj", rows)) * self._linear(h2, i, "up_proj", rows)
            x = x + self._linear(gated, i, "down_proj", rows)
        if logits_at is None:
            logits_at = [row.end - 1 for row in rows]
        last = rms_norm(x[logits_at], self.norm, c.rms_norm_eps)
        return F.linear(last, self.lm_head).float()


class DenseAttention:
    """Cache-free causal self-attention of each row over its own adapted K/V.

    The reference full-sequence forward: no cache is read or written.
    """

    def __init__(self, rows: list[Row]):
        self.rows = rows

    def attend(self, x: LayerInput) -> torch.Tensor:
        out = torch.empty(x.q.shape[0], x.q.shape[1] * x.q.shape[2], dtype=x.q.dtype, device=x.q.device)
        for row in self.rows:
            k, v = x.adapted_kv(row.slice, row.adapter)
            q = x.q[row.slice].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                enable_gqa=True,
            )
            out[row.slice] = o[0].transpose(0, 1).reshape(row.end - row.start, -1)
        return out


def dense_logits(
    model: LlamaModel, sequences: list[list[int]], adapters: list[LoRAAdapter | None] | None = None
) -> list[torch.Tensor]:
    """Logits ``[len(seq), vocab]`` of every position of each sequence, all run as one mixed batch.

    ``adapters[i]`` is sequence i's adapter (None: base model). Positions start at 0 in each row.
    """
    adapters = adapters or [None] * len(sequences)
    rows, start = [], 0
    for seq, adapter in zip(sequences, adapters, strict=True):
        rows.append(Row(start, start + len(seq), adapter))
        start += len(seq)
    ids = torch.tensor([t for seq in sequences for t in seq], device=model.device)
    positions = torch.cat([torch.arange(len(seq), device=model.device) for seq in sequences])
    logits = model.forward(ids, positions, rows, DenseAttention(rows), logits_at=list(range(start)))
    return [logits[row.slice] for row in rows]
