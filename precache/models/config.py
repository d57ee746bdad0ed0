"""The architecture facts our forward needs, read once from an HF config.

Every ``config.json`` field that changes the forward in transformers' modeling code for the
supported families is either honoured or refused here, before any weight is read ("honour it or
refuse it"; README, "Supported models"):

- honoured: ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads`` (GQA), ``head_dim``, ``rms_norm_eps``,
  ``tie_word_embeddings``, ``attention_bias`` (Llama/Qwen3: q/k/v/o biases; Qwen2 always has q/k/v
  biases), ``mlp_bias``, ``hidden_act`` (any parameter-free activation of transformers'
  ``ACT2FN``), Qwen3's q/k RMSNorm, ``rope_parameters`` / legacy ``rope_scaling`` (see
  :mod:`precache.models.rope`), ``sliding_window`` (Mistral: every layer), ``use_sliding_window``
  / ``max_window_layers`` / ``layer_types`` (Qwen2, Qwen3: per layer);
- no effect on an inference forward, accepted: ``attention_dropout``, ``initializer_range``,
  ``use_cache``, ``pad_token_id``, ``pretraining_tp`` (unused by transformers 5's Llama), the
  token ids (read by the engine's stop rule);
- refused with :class:`ModelLoadError`: another ``model_type``, an activation with learnable
  parameters or unknown to transformers, ``quantization_config`` (quantized weights; a folder
  converted from GGUF, ``quant_method: gguf``, holds de-quantised floats and is accepted),
  ``partial_rotary_factor`` below 1 (but with ``proportional`` RoPE), per-layer-type ``rope_parameters``, layer types other than
  full / sliding attention, a sliding layer without a window, a window below 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers.activations import ACT2CLS, ACT2FN

from precache.errors import ModelLoadError
from precache.models.rope import check_rope
from precache.registry import Registry

#: our forward (a model class) by HF ``model_type``; a family's module registers it (``llama.py``)
MODEL_REGISTRY: Registry[type] = Registry("model_type", ModelLoadError)
#: ``layer_types`` entries we implement (Qwen2/Qwen3 configs)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family architecture (Llama, Mistral, Qwen2, Qwen3).

    ``attention_bias`` is Qwen2's bias on q/k/v; ``qk_norm`` is Qwen3's per-head RMSNorm on q and k
    before RoPE. ``layer_windows[l]`` is layer l's sliding window in tokens (None: full causal
    attention): query position ``t`` reads key positions ``p`` with ``t - window < p <= t``, as
    transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``).
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
    hidden_act: str = "silu"
    mlp_bias: bool = False
    layer_windows: tuple[int | None, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        """Sliding window of ``layer`` in tokens, or None (full causal attention)."""
        return self.layer_windows[layer] if self.layer_windows else None

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
            ModelLoadError: the ``model_type`` is not a Llama-family architecture we implement, or a
                field changes the forward in a way we do not implement (the message names it).
        """
        model_type = MODEL_REGISTRY.canonical(getattr(hf_config, "model_type", None) or "")
        _check_quantization(hf_config)
        check_rope(hf_config)
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
            hidden_act=_activation(hf_config),
            mlp_bias=model_type == "llama" and bool(getattr(hf_config, "mlp_bias", False)),
            layer_windows=_layer_windows(hf_config, model_type),
        )


def _check_quantization(hf_config) -> None:
    """Refuse quantized weights. ``quant_method: gguf`` is what transformers writes into a folder
    saved from a GGUF-loaded model (our conversions): its safetensors hold de-quantised floats."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return
    method = (
        quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
    )
    method = getattr(method, "value", method)  # a QuantizationMethod enum on config objects
    if method != "gguf":
        raise ModelLoadError(
            f"quantization_config (quant_method '{method}') is not supported: precache runs "
            "unquantized fp32/bf16/fp16 safetensors checkpoints and GGUF files (de-quantised once)"
        )


def _activation(hf_config) -> str:
    """``hidden_act`` if transformers' ``ACT2FN`` has it without learnable parameters."""
    name = getattr(hf_config, "hidden_act", "silu")
    if name not in ACT2CLS:
        raise ModelLoadError(
            f"hidden_act '{name}' is unknown to transformers (known: {', '.join(sorted(ACT2CLS))})"
        )
    if any(True for _ in ACT2FN[name].parameters()):
        raise ModelLoadError(
            f"hidden_act '{name}' has learnable parameters, which precache does not load "
            "(supported: parameter-free activations such as silu, gelu, gelu_pytorch_tanh, relu)"
        )
    return name


def _layer_windows(hf_config, model_type: str) -> tuple[int | None, ...]:
    """Per-layer sliding windows as transformers' modeling code applies them.

    Mistral windows every layer when ``sliding_window`` is set (its modeling ignores
    ``layer_types``); Qwen2/Qwen3 window the layers whose ``layer_types`` entry is
    ``sliding_attention`` (the config derives them from ``use_sliding_window`` and
    ``max_window_layers`` when absent); Llama has no window.
    """
    n = hf_config.num_hidden_layers
    if model_type == "llama":
        return (None,) * n
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"sliding_window={window!r} must be a positive number of tokens or null")
    if model_type == "mistral":
        return (window,) * n
    types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * n)
    if len(types) != n:
        raise ModelLoadError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    for i, kind in enumerate(types):
        if kind not in SUPPORTED_LAYER_TYPES:
            raise ModelLoadError(
                f"layer_types[{i}] = '{kind}' is not supported (supported: {', '.join(SUPPORTED_LAYER_TYPES)})"
            )
        if kind == "sliding_attention" and window is None:
            raise ModelLoadError(
                f"layer_types[{i}] is 'sliding_attention' but sliding_window is null "
                "(use_sliding_window is false or sliding_window unset)"
            )
    return tuple(window if kind == "sliding_attention" else None for kind in types)
