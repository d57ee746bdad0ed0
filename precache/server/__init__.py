"""OpenAI-compatible HTTP server: continuous batching across sessions and adapters, cross-adapter
prefix reuse, Prometheus metrics (``precache serve``)."""

from precache.server.app import create_app
from precache.server.config import ServerConfig
from precache.server.live import LiveServer

__all__ = ["LiveServer", "ServerConfig", "create_app"]
