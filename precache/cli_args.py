"""``argparse`` types that the command modules of several packages share (agents, bench, server).

Names (methods, benchmarks, backends) are checked by their registry (:mod:`precache.registry`),
not here.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An ``argparse`` ``type``: an integer >= 1.

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1 (argparse prints it as a usage error).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An ``argparse`` ``type``: a finite number > 0 (seconds, say).

    Raises:
        argparse.ArgumentTypeError: not a number, not finite, or not above 0.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


#: ``--split``: ``precache.agents.data.SPLITS`` (spelled here: the parser needs no torch)
SPLITS = ("dev", "train", "all")


def add_split_argument(parser: argparse.ArgumentParser) -> None:
    """``--split dev | train | all`` (default dev): which of the benchmark's committed questions a
    command runs (the fixed split of ``precache/assets/{hotpotqa,scienceqa}/split.json``)."""
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="dev",
        help="the questions to run: dev (held out; default), train (the ones the committed "
        "adapters were trained on) or all",
    )


#: ``--dtype``: the weights' and the compute dtype (the KV caches follow the compute dtype)
DTYPES = ("float32", "bfloat16")


#: ``--quantization``: ``precache.models.quant.QUANTIZATIONS`` (spelled here: the parser needs no torch)
QUANTIZATIONS = ("int8", "int4")
#: ``--kv-cache-dtype``: "auto" and ``precache.models.quant.KV_CACHE_DTYPES``' long names
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype float32 | bfloat16`` (default: ``precache.load_model``'s, bfloat16 on CUDA and
    float32 on a CPU), ``--quantization int8 | int4`` (weight-only on a CPU), ``--kv-cache-dtype``
    (the block pool's dtype) and ``--eager`` (no compiled decode step); docs/performance.md,
    "Precision on CPU", "KV-cache dtype" and "Compiled decode"."""
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="weights, compute and (unless --kv-cache-dtype) KV caches (default: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="int8 | int4: the projections as int8 (per row) or int4 (groups of 32 inputs) weight-only, "
        "the LM head int8, on a CPU (compute stays at --dtype; docs/performance.md)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the KV block pool's dtype (auto: --dtype); bfloat16 halves an fp32 model's cache and "
        'what each decode step reads from it (docs/performance.md, "KV-cache dtype")',
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="run decode steps eagerly; without it a CPU runs each decode step as one compiled graph "
        "(compiled at the first step, cached under $PRECACHE_HOME/inductor)",
    )


def model_options(args: argparse.Namespace) -> dict:
    """``load_model``'s ``dtype``, ``quantization``, ``compile`` and ``kv_cache_dtype`` from
    ``--dtype``, ``--quantization``, ``--eager`` and ``--kv-cache-dtype`` (``compile`` None:
    ``load_model``'s default)."""
    return {
        "dtype": dtype_of(args),
        "quantization": getattr(args, "quantization", None),
        "compile": False if getattr(args, "eager", False) else None,
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
    }


def dtype_of(args: argparse.Namespace):
    """The ``torch.dtype`` of ``--dtype`` (None: ``load_model``'s default)."""
    name = getattr(args, "dtype", None)
    if name is None:
        return None
    import torch  # the parser needs no torch; only a command that loads a model does

    return getattr(torch, name)
