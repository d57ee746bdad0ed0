"""Rotary position embedding (RoPE) tables, with every scaling type transformers knows.

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (default, linear,
dynamic, yarn, longrope, llama3), so a checkpoint's ``rope_parameters`` mean the same here as in
HF. Dynamic NTK scaling is applied at its base length (contexts here stay below
``max_position_embeddings``).
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (base**exponents), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding:
    """cos / sin tables for positions ``[0, max_positions)``, in the rotate-half layout of HF Llama.

    ``apply(x, cos, sin)`` rotates ``x`` of shape ``[n, heads, head_dim]`` with tables
    ``[n, head_dim]``: ``x * cos + rotate_half(x) * sin`` (Su et al., RoFormer, eq. 34).
    """

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype: torch.dtype, device=None):
        inv_freq, scaling = _inv_freq(hf_config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scaling).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``[n, head_dim]`` for integer ``positions`` ``[n]``."""
        return self.cos[positions], self.sin[positions]

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for the contiguous positions ``[start, end)`` (views, no copy)."""
        return self.cos[start:end], self.sin[start:end]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[n, heads, head_dim]`` by tables ``[n, head_dim]``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
