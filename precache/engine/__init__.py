"""Engine, scheduler, requests, sessions and sampling."""

from precache.engine.concurrency import run_concurrently
from precache.engine.config import EngineConfig, SchedulerConfig
from precache.engine.engine import Engine
from precache.engine.outputs import StreamChunk, TokenLogprob, Turn
from precache.engine.request import Phase, Request, RequestState
from precache.engine.rows import Batch
from precache.engine.session import Session

__all__ = [
    "Batch",
    "Engine",
    "EngineConfig",
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
