"""``precache`` command line: ``run | eval | adapters | bench | fidelity | serve``.

Each package registers its own sub-commands through an ``add_commands(subparsers)`` function, so
this module only wires them together. Sub-commands raise :class:`~precache.errors.PrecacheError`
on bad input and never catch it: :func:`guard`, applied to every sub-command by :func:`main`, turns
it into one line on stderr and exit code 2.

Quiet by default (:func:`set_verbosity`): precache's own messages at INFO, other libraries only
at WARNING, no transformers / hub progress bars, no deprecation warnings; ``-v`` shows the
libraries' INFO logs and warnings, ``-vv`` DEBUG everywhere.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
import warnings
from collections.abc import Callable

import huggingface_hub.utils
import transformers.utils.logging as hf_logging
from rich.console import Console
from rich.text import Text

from precache import __version__
from precache.errors import PrecacheError

#: exit code of a command stopped by bad input (a PrecacheError), as argparse's usage errors
EXIT_BAD_INPUT = 2

#: the modules that register sub-commands, in order (``cluster.cli`` extends ``server.cli``'s ``serve``)
_COMMAND_MODULES = (
    "precache.demo",
    "precache.agents.cli",
    "precache.bench.cli",
    "precache.server.cli",
    "precache.cluster.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precache", description="KV cache sharing for multi-LoRA agent systems"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="-v: library logs, progress bars and warnings too; -vv: debug logging",
    )
    parser.add_argument("--version", action="version", version=f"precache {__version__}")
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
        try:
            return int(command(args) or 0)
        except PrecacheError as exc:
            line = Text.assemble((type(exc).__name__, "red"), f": {exc}")
            Console(stderr=True, soft_wrap=True).print(line, highlight=False)
            return EXIT_BAD_INPUT

    return run


def set_verbosity(verbose: int) -> None:
    """Logging, warnings and library progress bars for ``verbose`` = the number of ``-v`` flags.

    0: precache's loggers at INFO (the server's access lines), every other logger at WARNING,
    transformers at ERROR with no progress bar ("Loading weights"), hub progress bars off,
    ``DeprecationWarning`` and ``FutureWarning`` ignored. 1: the root logger at INFO,
    transformers at WARNING (its INFO is a dump of every config it reads) with its bars, Python's
    default warning filters. 2 or more: DEBUG everywhere.
    """
    root_level = (logging.WARNING, logging.INFO)[verbose] if verbose < 2 else logging.DEBUG
    logging.basicConfig(level=root_level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(root_level)
    logging.getLogger("precache").setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    if verbose == 0:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
    else:
        hf_logging.set_verbosity(logging.WARNING if verbose == 1 else root_level)
        hf_logging.enable_progress_bar()
        huggingface_hub.utils.enable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_verbosity(args.verbose)
    return guard(args.func)(args)


if __name__ == "__main__":
    sys.exit(main())
