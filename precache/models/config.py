"""The architecture facts our forward needs, read once from an HF config.

Every ``config.json`` field that changes the forward in transformers' modeling code for the
supported families is either honoured or refused here, before any weight is read ("honour it or
refuse it"; docs/library.md, "Supported models"). This module reads the fields every family shares; the
family's module (found through :data:`~precache.models.family.MODEL_REGISTRY` by ``model_type``)
decides the rest (:meth:`~precache.models.family.ModelFamily.config_fields`):

- honoured: ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads`` (GQA), ``head_dim``, ``rms_norm_eps``,
  ``tie_word_embeddings``, ``hidden_act`` (any parameter-free activation of transformers'
  ``ACT2FN``), ``rope_parameters`` / legacy ``rope_scaling`` (see :mod:`precache.models.rope`);
  by the family: biases, q/k norms and sliding windows (``sliding_window``, or per layer
  ``use_sliding_window`` / ``max_window_layers`` / ``layer_types``: :func:`windows_by_layer_type`);
- no effect on an inference forward, accepted: ``attention_dropout``, ``initializer_range``,
  ``use_cache``, ``pad_token_id``, ``pretraining_tp`` (unused by transformers 5's Llama), the
  token ids (read by the engine's stop rule);
- refused with :class:`ModelLoadError`: a ``model_type`` no family registered, an activation with
  learnable parameters or unknown to transformers, ``quantization_config`` (quantized weights; a
  folder converted from GGUF, ``quant_method: gguf``, holds de-quantised floats and is accepted),
  ``partial_rotary_factor`` below 1 (but with ``proportional`` RoPE), per-layer-type
  ``rope_parameters``, layer types other than full / sliding attention, a sliding layer without a
  window, a window below 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers.activations import ACT2CLS, ACT2FN

from precache.errors import ModelLoadError
from precache.models.family import MODEL_REGISTRY
from precache.models.rope import check_rope

#: ``layer_types`` entries we implement (Qwen2/Qwen3 configs)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's architecture (the families registered in
    :data:`~precache.models.family.MODEL_REGISTRY`: Llama, Mistral, Qwen2, Qwen3).

    ``attention_bias``: biases on q/k/v (always under Qwen2); ``qk_norm``: a per-head RMSNorm on q
    and k before RoPE (Qwen3); ``mlp_bias``: biases on the MLP projections. ``layer_windows[l]`` is layer l's sliding window in tokens (None: full causal
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
        """Build from a ``transformers.PretrainedConfig``: the shared fields here, the family's own
        from the class registered for its ``model_type``.

        Raises:
            ModelLoadError: no family registered the ``model_type``, or a field changes the forward
                in a way we do not implement (the message names it).
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
            name=getattr(hf_config, "_name_or_path", "") or "",
            hidden_act=_activation(hf_config),
            **MODEL_REGISTRY[model_type].config_fields(hf_config, model_type),
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


def sliding_window(hf_config) -> int | None:
    """``sliding_window`` in tokens, or None when unset.

    Raises:
        ModelLoadError: a window that is not a positive integer.
    """
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"sliding_window={window!r} must be a positive number of tokens or null")
    return window


def windows_by_layer_type(hf_config) -> tuple[int | None, ...]:
    """Per-layer sliding windows from ``layer_types``: :func:`sliding_window` at each
    ``sliding_attention`` layer, None at each ``full_attention`` one (transformers' configs derive
    ``layer_types`` from ``use_sliding_window`` and ``max_window_layers`` when absent; no entry:
    every layer full).

    Raises:
        ModelLoadError: a bad window, ``layer_types`` of another length than the layers, a layer
            type other than :data:`SUPPORTED_LAYER_TYPES`, or a sliding layer without a window.
    """
    n = hf_config.num_hidden_layers
    window = sliding_window(hf_config)
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
