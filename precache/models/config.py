"""The architecture facts our forward needs, read once from an HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from precache.errors import ModelLoadError

#: HF ``model_type`` values our Llama-family forward implements.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family architecture (Llama, Mistral, Qwen2, Qwen3).

    ``attention_bias`` is Qwen2's bias on q/k/v; ``qk_norm`` is Qwen3's per-head RMSNorm on q and k
    before RoPE. ``sliding_window`` is accepted but not applied (contexts here stay below it).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    name: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """``(d_in, d_out)`` of projection ``proj`` in one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[proj]

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Build from a ``transformers.PretrainedConfig``.

        Raises:
            ModelLoadError: the ``model_type`` is not a Llama-family architecture we implement.
        """
        model_type = getattr(hf_config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model_type '{model_type}' is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            name=getattr(hf_config, "_name_or_path", "") or "",
        )
