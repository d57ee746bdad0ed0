"""``precache`` command line: ``run | eval | adapters | bench | fidelity | serve``.

Each package registers its own sub-commands through an ``add_commands(subparsers)`` function, so
this module only wires them together. Sub-commands raise :class:`~precache.errors.PrecacheError`
on bad input and never catch it: :func:`guard`, applied to every sub-command by :func:`main`, turns
it into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
from collections.abc import Callable

#: exit code of a command stopped by bad input (a PrecacheError), as argparse's usage errors
EXIT_BAD_INPUT = 2

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


def guard(command: Callable[[argparse.Namespace], int | None]) -> Callable[[argparse.Namespace], int]:
    """Wrap a sub-command so that bad input ends it with one line, ``ErrorType: message``, on
    stderr and exit code 2 (:data:`EXIT_BAD_INPUT`), no traceback. Only
    :class:`~precache.errors.PrecacheError` is caught: any other exception is a bug and keeps its
    traceback.
    """

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from rich.console import Console
        from rich.text import Text

        from precache.errors import PrecacheError

        try:
            return int(command(args) or 0)
        except PrecacheError as exc:
            line = Text.assemble((type(exc).__name__, "red"), f": {exc}")
            Console(stderr=True, soft_wrap=True).print(line, highlight=False)
            return EXIT_BAD_INPUT

    return run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    return guard(args.func)(args)


if __name__ == "__main__":
    sys.exit(main())
