"""The compute thread: every forward, sampling step and model load of the process runs on one OS
thread, whichever thread asks for it.

torch's CPU kernels parallelise with OpenMP, which keeps one thread team per calling thread. With
two teams in a process (a model loaded on the main thread and stepped on a server loop thread, or
several threads each driving steps), every parallel region got slower on a 2-core machine: a
SmolLM2 decode step of 3 rows took 150 ms when one thread did all the work, 195-225 ms when two to
four threads did (issue 20). Running the work on one thread keeps one team.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

R = TypeVar("R")

_executor: ThreadPoolExecutor | None = None
_guard = threading.Lock()
_local = threading.local()


def _run(fn: Callable[[], R], threads: int) -> R:
    if torch.get_num_threads() != threads:  # the caller's setting (OpenMP keeps it per thread)
        torch.set_num_threads(threads)
    _local.on_compute = True
    try:
        return fn()
    finally:
        _local.on_compute = False


def on_compute(fn: Callable[[], R]) -> R:
    """``fn()`` on the compute thread (in place when called from it), with the caller's
    ``torch.get_num_threads()``; its result or exception comes back to the caller."""
    global _executor
    if getattr(_local, "on_compute", False):
        return fn()
    with _guard:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="precache-compute")
    return _executor.submit(_run, fn, torch.get_num_threads()).result()
