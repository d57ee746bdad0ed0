"""Model families: the registry by HF ``model_type``, and what a family's module provides.

A family is one module in ``precache/models/`` (``llama.py``: Llama, Mistral, Qwen2, Qwen3) built on
the shared layers (:mod:`precache.models.layers`, :mod:`precache.models.rope`,
:mod:`precache.models.quant`) and the model/cache contract (:mod:`precache.models.contract`). It
registers its forward class under each ``model_type`` it implements
(``MODEL_REGISTRY.register("llama", LlamaModel)``) and is imported once by
``precache/models/__init__.py``; nothing else names a family. :meth:`ModelConfig.from_hf
<precache.models.config.ModelConfig.from_hf>` reads the fields every family shares and asks the
registered class for the rest (:meth:`ModelFamily.config_fields`); :func:`precache.models.model_from_hf`
builds the registered class. Any branch on ``model_type`` lives in the family's module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from precache.errors import ModelLoadError
from precache.registry import Registry

if TYPE_CHECKING:
    from precache.models.config import ModelConfig
    from precache.models.contract import LayerAttention, Row


class ModelFamily(Protocol):
    """What a registered model class provides (the engine, the cache and the sharing methods use
    nothing else of a model).

    - ``config_fields(hf_config, model_type)`` (classmethod): the :class:`ModelConfig` fields the
      family decides from an HF config: ``attention_bias``, ``qk_norm``, ``mlp_bias`` and
      ``layer_windows`` (per-layer sliding windows in tokens, None where a layer attends to the
      whole prefix). Raises :class:`ModelLoadError` naming a field it does not implement.
    - ``cls(config, hf_config, state, tokenizer, path, max_context)``: the forward over an HF
      state dict (``state``: parameter name -> tensor, on the model's device); ``max_context``
      tokens (None: ``max_position_embeddings``) sizes the RoPE tables.
    - the :class:`~precache.models.contract.KVProjector` hooks the cache calls (``config``,
      ``rope``, ``dtype``, ``device``, ``finish_kv``), ``max_context``, ``tokenizer``,
      ``generation_config`` and ``kv_cache_dtype`` (set by the loader), and :meth:`forward`.
    """

    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_context: int

    @classmethod
    def config_fields(cls, hf_config: Any, model_type: str) -> dict[str, Any]: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: list[Row],
        attention: LayerAttention,
        logits_at: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(logits_at), vocab]`` (fp32) of the flattened batch: ``input_ids`` and
        ``positions`` ``[N]`` cut into ``rows``, each with its adapter; ``attention`` called at
        every layer."""
        ...


#: the registered model classes by HF ``model_type`` (each family's module registers its own)
MODEL_REGISTRY: Registry[type[ModelFamily]] = Registry("model_type", ModelLoadError)
