"""Helpers every benchmark command shares: method lists, the HF baseline model, special ids."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from precache.errors import UnknownMethodError


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def check_method(name: str) -> str:
    """``name`` if :func:`~precache.methods.make_method` takes it (one of ``METHODS``, any case,
    ``_`` for ``-``, or ``rebaseshared`` for ``rebaseshared-lp``): checked before a model loads.

    Raises:
        UnknownMethodError: it does not; the message lists the methods.
    """
    from precache.methods import METHODS

    if name.lower().replace("_", "-") not in (*METHODS, "rebaseshared"):
        raise UnknownMethodError(f"unknown sharing method '{name}' (methods: {', '.join(METHODS)})")
    return name


def methods_with_reference(text: str) -> list[str]:
    """Method names from a comma-separated list, NonShared (the reference) first and always.

    Raises:
        UnknownMethodError: a name is not a method.
    """
    from precache.methods import METHODS

    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise UnknownMethodError(f"unknown method(s) {', '.join(unknown)} (methods: {', '.join(METHODS)})")
    return ["nonshared", *(m for m in names if m != "nonshared")]  # the reference always runs


def hf_model_of(model):
    """The HF model the baseline wraps, loaded from ``model``'s checkpoint (no tensors shared)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()


def special_ids(model) -> list[int]:
    """Token ids a random benchmark stream leaves out (the tokenizer's special tokens)."""
    return list(getattr(model.tokenizer, "all_special_ids", []) or [])


def add_common_args(parser: argparse.ArgumentParser, default_methods: str | None) -> None:
    """``--adapters --model --json --markdown --threads`` (and ``--methods`` unless None)."""
    if default_methods is not None:
        parser.add_argument("--methods", default=default_methods, help="comma-separated sharing methods")
    parser.add_argument("--adapters", default="qv", help="qv | all (committed sets) | DIR with DIR/<agent>/")
    parser.add_argument("--model", help="base checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--json", required=True, help="results file")
    parser.add_argument("--markdown", help="also write the markdown table here")
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("PRECACHE_THREADS", 0)), help="torch threads"
    )


def write_results(result: dict, markdown: str, args: argparse.Namespace) -> int:
    """Record the command's arguments in ``result``, write it to ``--json``, print ``markdown`` and
    write it to ``--markdown`` when given. Returns the exit code 0."""
    from precache.bench import report
    from precache.terminal import console

    result["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    report.write_json(result, args.json)
    console().print(markdown)
    if args.markdown:
        Path(args.markdown).write_text(markdown, encoding="utf-8")
    return 0
