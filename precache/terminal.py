"""Terminal output of the commands: consoles that print tables whole when piped, progress bars
that show on a terminal and stay quiet in a pipe or a log file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: columns of a console whose output is not a terminal (a pipe, a file): wide enough that no table
#: is cut or wrapped; rich's own default there is 80
PIPE_WIDTH = 1000


def console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr): the terminal's width on a terminal, else
    :data:`PIPE_WIDTH` columns with soft wrapping, so ``precache ... | cat`` shows every table
    and line whole."""
    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return probe
    return Console(stderr=stderr, width=PIPE_WIDTH, soft_wrap=True)


@contextlib.contextmanager
def progress(total: int, description: str | None) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr over ``total`` items; yields ``advance()``, to call once per item
    finished (from any thread). Shown only when stderr is a terminal and ``description`` is given;
    removed when done."""
    err = Console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=description is None or not err.is_terminal,
    )
    with bar:
        task = bar.add_task(description or "", total=total)
        yield lambda: bar.advance(task)
