"""Engine, scheduler, requests, sessions and sampling."""

from precache.engine.concurrency import run_concurrently
from precache.engine.engine import Engine
from precache.engine.outputs import StreamChunk, TokenLogprob, Turn
from precache.engine.request import Phase, Request, RequestState
from precache.engine.scheduler import Batch, SchedulerConfig
from precache.engine.session import Session

__all__ = [
    "Batch",
    "Engine",
    "Phase",
    "Request",
    "RequestState",
    "SchedulerConfig",
    "Session",
    "StreamChunk",
    "TokenLogprob",
    "Turn",
    "run_concurrently",
]
