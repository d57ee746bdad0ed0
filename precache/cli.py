"""``precache`` command line: ``run | eval | adapters | bench | fidelity | serve``.

Each package registers its own sub-commands through an ``add_commands(subparsers)`` function, so
this module only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

_COMMAND_MODULES = ("precache.demo", "precache.agents.cli", "precache.bench.cli", "precache.server.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precache", description="KV cache sharing for multi-LoRA agent systems"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a missing dependency inside the module is a real error
                raise
            continue
        module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    from precache.errors import PrecacheError

    try:
        return int(args.func(args) or 0)
    except PrecacheError as exc:  # bad input: one clear line, no traceback
        logging.getLogger("precache").error("%s: %s", type(exc).__name__, exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
