"""Rotary position embedding (RoPE) tables, with every scaling type transformers knows.

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (linear, dynamic,
yarn, longrope, llama3, proportional; ``default`` is ``base ** (-2i / head_dim)``), so a
checkpoint's ``rope_parameters`` (or legacy ``rope_scaling`` / ``rope_theta``, which transformers
folds into ``rope_parameters``) mean the same here as in HF.

Two types recompute their frequencies from the sequence length in HF's forward: ``dynamic`` (NTK
scaling past ``max_position_embeddings``) and ``longrope`` (long factors past
``original_max_position_embeddings``). A KV cache holds keys rotated once, so we honour them up to
that length, where HF's frequencies are the static ones, and refuse positions past it
(:func:`static_position_limit`).
"""

from __future__ import annotations

import logging

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from precache.errors import ModelLoadError

logger = logging.getLogger(__name__)


def _params(hf_config) -> dict:
    return getattr(hf_config, "rope_parameters", None) or {}


def check_rope(hf_config) -> None:
    """Refuse RoPE settings whose HF forward we cannot reproduce (before any weight is read).

    Raises:
        ModelLoadError: ``rope_parameters`` per layer type, an unknown ``rope_type``, or
            ``partial_rotary_factor`` below 1 (rotating part of each head) with a type other than
            ``proportional``.
    """
    params = _params(hf_config)
    if params and "rope_type" not in params and any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(
            f"rope_parameters per layer type ({', '.join(params)}) are not supported "
            "(supported: one rope_parameters dict for every layer)"
        )
    rope_type = params.get("rope_type", "default")
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(
            f"rope_parameters.rope_type '{rope_type}' is not supported "
            f"(supported: default, {', '.join(ROPE_INIT_FUNCTIONS)})"
        )
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    # 'proportional' keeps one frequency per head pair (zero past the rotated part), which rotates
    # part of each head exactly; the other types would hand HF's rotate-half a shorter table
    if factor is not None and float(factor) != 1.0 and rope_type != "proportional":
        raise ModelLoadError(
            f"partial_rotary_factor={factor} is not supported with rope_type '{rope_type}' "
            "(supported: 1.0, or any factor with rope_type 'proportional')"
        )


def static_position_limit(hf_config) -> int | None:
    """Positions (exclusive) up to which HF's RoPE frequencies are static, or None (all positions).

    ``dynamic``: ``max_position_embeddings`` (HF regrows the frequencies past it); ``longrope``:
    ``original_max_position_embeddings`` (HF switches to the long factors past it).
    """
    params = _params(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        return int(hf_config.max_position_embeddings)
    if rope_type == "longrope":
        return int(params.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
    return None


def context_length(hf_config, max_position_embeddings: int, max_context: int | None) -> int:
    """The context a model serves, in tokens: ``max_context`` (None: ``max_position_embeddings``),
    capped at :func:`static_position_limit` (logged when it cuts).

    Raises:
        ModelLoadError: ``max_context`` is past the static range of a dynamic / longrope RoPE.
    """
    limit = static_position_limit(hf_config)
    wanted = max_context or max_position_embeddings
    if limit is None:
        return wanted
    rope_type = hf_config.rope_parameters["rope_type"]
    if max_context is not None and max_context > limit:
        raise ModelLoadError(
            f"max_context={max_context} is past {limit}, where '{rope_type}' RoPE recomputes its "
            f"frequencies from the sequence length (rope_parameters.rope_type): keys in a KV cache "
            f"cannot follow; use max_context <= {limit}"
        )
    context = min(wanted, limit)
    if context < wanted:
        logger.info("context capped at %d tokens: '%s' RoPE is static only up to there", context, rope_type)
    return context


def _inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _params(hf_config)
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
        """Rotate ``x`` ``[..., heads, head_dim]`` by tables ``[..., head_dim]`` (one per leading
        index: ``[n, heads, D]`` by ``[n, D]``, or ``[B, L, heads, D]`` by ``[B, L, D]``)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)
