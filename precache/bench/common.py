"""Helpers every benchmark command shares: method lists, the HF baseline model, special ids."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from precache.bench import report
from precache.cli_args import add_dtype_argument
from precache.methods import METHOD_REGISTRY
from precache.terminal import console


def methods_with_reference(text: str) -> list[str]:
    """Method names from a comma-separated list (any spelling the registry takes), as registered,
    NonShared (the reference) first and always.

    Raises:
        UnknownMethodError: a name is not a method; the message names every unknown one.
    """
    names = METHOD_REGISTRY.canonical_many(m.strip() for m in text.split(",") if m.strip())
    return ["nonshared", *dict.fromkeys(m for m in names if m != "nonshared")]  # the reference always runs


def hf_model_of(model):
    """The HF model the baseline wraps, loaded from ``model``'s checkpoint (no tensors shared)."""
    return AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()


def special_ids(model) -> list[int]:
    """Token ids a random benchmark stream leaves out (the tokenizer's special tokens)."""
    return list(getattr(model.tokenizer, "all_special_ids", []) or [])


def ordinary_ids(model) -> list[int]:
    """Every token id of ``model``'s vocabulary but the special ones (:func:`special_ids`), in
    order: what a random prompt is drawn from."""
    special = set(special_ids(model))
    return [i for i in range(model.config.vocab_size) if i not in special]


def add_common_args(parser: argparse.ArgumentParser, default_methods: str | None) -> None:
    """``--adapters --model --dtype --json --markdown --threads`` (and ``--methods`` unless None)."""
    if default_methods is not None:
        parser.add_argument("--methods", default=default_methods, help="comma-separated sharing methods")
    parser.add_argument("--adapters", default="qv", help="qv | all (committed sets) | DIR with DIR/<agent>/")
    parser.add_argument("--model", help="base checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    add_dtype_argument(parser)
    parser.add_argument("--json", required=True, help="results file")
    parser.add_argument("--markdown", help="also write the markdown table here")
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("PRECACHE_THREADS", 0)), help="torch threads"
    )


def write_results(result: dict, markdown: str, args: argparse.Namespace) -> int:
    """Record the command's arguments in ``result``, write it to ``--json``, print ``markdown`` and
    write it to ``--markdown`` when given. Returns the exit code 0."""
    result["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    report.write_json(result, args.json)
    console().print(markdown)
    if args.markdown:
        Path(args.markdown).write_text(markdown, encoding="utf-8")
    return 0
