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
