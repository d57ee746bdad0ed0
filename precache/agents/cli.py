"""``precache adapters train | check``, ``precache run`` and ``precache eval`` sub-commands."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

ADAPTER_ROOT = Path(__file__).resolve().parents[2] / "adapters" / "smollm2-135m"


def _train(args: argparse.Namespace) -> int:
    from precache.agents.train import train_adapters

    out = Path(args.out) if args.out else ADAPTER_ROOT / args.set
    train_adapters(out, targets=args.set, steps=args.steps, seed=args.seed)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``adapters``, ``run`` and ``eval`` on the ``precache`` parser."""
    adapters = sub.add_parser("adapters", help="train or check the plan / action / reflect adapters")
    adapters_sub = adapters.add_subparsers(dest="adapters_command", required=True)
    train = adapters_sub.add_parser("train", help="train one adapter set on gold HotpotQA trajectories")
    train.add_argument("--set", choices=("qv", "all"), default="qv", help="projections the LoRA targets")
    train.add_argument("--steps", type=int, default=60, help="optimizer steps per role (batch 4)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", help="output folder (default adapters/smollm2-135m/<set>)")
    train.set_defaults(func=_train)
