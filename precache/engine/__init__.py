"""Engine, sessions and sampling."""

from precache.engine.engine import Engine
from precache.engine.session import Session, StreamChunk, Turn

__all__ = ["Engine", "Session", "StreamChunk", "Turn"]
