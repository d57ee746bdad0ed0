"""Offline concurrency: N independent trajectories on threads whose forwards are batched."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TypeVar

from precache.terminal import progress

T = TypeVar("T")
R = TypeVar("R")


def run_concurrently(
    fn: Callable[[T], R], items: Iterable[T], concurrency: int = 1, desc: str | None = None
) -> list[R]:
    """``[fn(item) for item in items]`` on ``concurrency`` threads, results in the order of ``items``,
    with a progress bar when ``desc`` is given (on a terminal: :func:`precache.terminal.progress`).
    Threads whose ``fn`` waits on engine requests drive the engine's steps together, so their
    forwards are batched (:meth:`Scheduler.drive`);
    ``concurrency=1`` runs in the calling thread. The first exception is raised once the started
    items are over (the others are not started).

    Raises:
        ValueError: ``concurrency < 1``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    items = list(items)
    with progress(len(items), desc) as advance:
        if concurrency == 1:
            out = []
            for item in items:
                out.append(fn(item))
                advance()
            return out
        with ThreadPoolExecutor(min(concurrency, max(len(items), 1)), thread_name_prefix="precache") as pool:
            futures = [pool.submit(fn, item) for item in items]
            error: BaseException | None = None
            for future in as_completed(futures):
                advance()
                if error is None and not future.cancelled() and future.exception() is not None:
                    error = future.exception()
                    for f in futures:
                        f.cancel()
        if error is not None:
            raise error
        return [f.result() for f in futures]
