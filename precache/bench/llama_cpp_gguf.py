"""The llama.cpp that ``make llama-cpp`` built, and the GGUF files the llama.cpp baseline
(:mod:`precache.bench.llama_cpp`) serves: the model and each adapter converted by llama.cpp's own
converters (``convert_hf_to_gguf.py``, ``convert_lora_to_gguf.py``; 4-bit weights by
``llama-quantize`` from the f32 file), each converted once and cached under
``~/.cache/precache/llama-cpp`` (``$PRECACHE_CACHE/llama-cpp``), rebuilt when its source changes.

Nothing of llama.cpp is committed or installed by ``make install``: ``make llama-cpp`` builds
llama-server from the tree llama-cpp-python vendors (``benchmarks/llama_cpp/install.sh``) into
``.llama-cpp/`` or ``$PRECACHE_LLAMA_CPP``; without it the baseline is refused with that command.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from precache.errors import PrecacheError

#: environment variable naming the folder ``make llama-cpp`` built (default ``.llama-cpp``)
ENV_DIR = "PRECACHE_LLAMA_CPP"
DEFAULT_DIR = ".llama-cpp"
#: weight types the converter does not write: llama-quantize makes them from the f32 GGUF
QUANTIZED_TYPES = {"q4_0": "Q4_0"}


class LlamaCppMissingError(PrecacheError):
    """The llama.cpp baseline was asked for, but llama-server is not built."""


@dataclass(frozen=True)
class LlamaCppTree:
    """A built llama.cpp: ``server`` (llama-server) and the converters' folder ``src``."""

    root: Path
    server: Path
    src: Path

    @property
    def version(self) -> str:
        """The llama-cpp-python sdist the tree came from (its folder name)."""
        return self.src.resolve().parent.parent.name


def find_llama_cpp(root: str | os.PathLike | None = None) -> LlamaCppTree:
    """The llama.cpp that ``make llama-cpp`` built under ``root``, ``$PRECACHE_LLAMA_CPP``,
    ``.llama-cpp`` in the working directory, or ``.llama-cpp`` in the checkout an editable install
    runs from.

    Raises:
        LlamaCppMissingError: no llama-server or converter there (the message says how to build it).
    """
    if root is None and not os.environ.get(ENV_DIR) and not Path(DEFAULT_DIR).is_dir():
        # an editable install run from elsewhere: the checkout's .llama-cpp, where make put it
        checkout = Path(__file__).resolve().parents[2] / DEFAULT_DIR
        root = checkout if checkout.is_dir() else None
    base = Path(root or os.environ.get(ENV_DIR) or DEFAULT_DIR).expanduser().resolve()
    server = base / "build" / "bin" / "llama-server"
    src = base / "src"
    missing = [
        p for p in (server, src / "convert_hf_to_gguf.py", src / "convert_lora_to_gguf.py") if not p.exists()
    ]
    if missing:
        raise LlamaCppMissingError(
            f"the llama-cpp baseline needs llama.cpp built under {base} (missing {missing[0]}): run "
            f"`make llama-cpp` (about 5 minutes on 2 cores), or set {ENV_DIR} to a folder it built"
        )
    return LlamaCppTree(base, server, src)


def _cache_dir() -> Path:
    return Path(os.environ.get("PRECACHE_CACHE", Path.home() / ".cache" / "precache")) / "llama-cpp"


def _fingerprint(*paths: Path) -> str:
    """Hash of each file's path, size and modification time under ``paths`` (a converted file is
    rebuilt when its source changes)."""
    h = hashlib.sha256()
    for path in paths:
        for f in (
            sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
        ):
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:20]


def _run_converter(args: list[str], what: str) -> None:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise PrecacheError(f"llama.cpp's converter failed on {what}:\n{tail}")


def _staged_checkpoint(checkpoint: Path, into: Path) -> Path:
    """``checkpoint`` as llama.cpp's converter reads it: the same files, and ``config.json``
    without the ``quantization_config`` that transformers' GGUF loader leaves behind (its weights
    are already dequantized to fp32 there)."""
    into.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.name != "config.json" and not (into / f.name).exists():
            (into / f.name).symlink_to(f.resolve())
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    (into / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return into


def _converted(out: Path, checkpoint: Path, args: list[str], what: str) -> Path:
    """``out``, written once by a llama.cpp converter run as ``args`` plus the staged
    ``checkpoint`` folder's path (``{staged}`` in ``args``) and ``--outfile``."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            staged = _staged_checkpoint(checkpoint, Path(tmp) / "checkpoint")
            part = out.with_suffix(".part")
            filled = [str(staged) if x == "{staged}" else x for x in args]
            _run_converter([*filled, "--outfile", str(part)], what)
            part.rename(out)
    return out


def gguf_model(tree: LlamaCppTree, checkpoint: str | os.PathLike, weight_type: str) -> Path:
    """The HF ``checkpoint`` folder converted by ``convert_hf_to_gguf.py --outtype weight_type``,
    cached under ``~/.cache/precache/llama-cpp``.

    Raises:
        PrecacheError: the converter failed (its last lines of stderr in the message).
    """
    checkpoint = Path(checkpoint)
    out = _cache_dir() / f"model-{_fingerprint(checkpoint)}-{tree.version}-{weight_type}.gguf"
    if weight_type in QUANTIZED_TYPES:  # llama-quantize over the f32 file
        if not out.exists():
            source = gguf_model(tree, checkpoint, "f32")
            quantize = tree.server.parent / "llama-quantize"
            part = out.with_suffix(".part")
            proc = subprocess.run(
                [str(quantize), str(source), str(part), QUANTIZED_TYPES[weight_type]],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
                raise PrecacheError(f"llama-quantize failed on {checkpoint} ({weight_type}):\n{tail}")
            part.rename(out)
        return out
    args = [str(tree.src / "convert_hf_to_gguf.py"), "{staged}", "--outtype", weight_type]
    return _converted(out, checkpoint, args, f"{checkpoint} ({weight_type})")


def gguf_adapter(tree: LlamaCppTree, adapter: str | os.PathLike, checkpoint: str | os.PathLike) -> Path:
    """The PEFT ``adapter`` folder converted by ``convert_lora_to_gguf.py`` (f32) against ``checkpoint``.

    Raises:
        PrecacheError: the converter failed.
    """
    adapter, checkpoint = Path(adapter), Path(checkpoint)
    out = _cache_dir() / f"lora-{_fingerprint(adapter, checkpoint)}-{tree.version}.gguf"
    args = [str(tree.src / "convert_lora_to_gguf.py"), "--base", "{staged}", "--outtype", "f32", str(adapter)]
    return _converted(out, checkpoint, args, str(adapter))
