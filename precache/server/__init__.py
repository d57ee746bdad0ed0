"""OpenAI-compatible HTTP server: continuous batching across sessions and adapters, cross-adapter
prefix reuse, Prometheus metrics (``precache serve``).

The names below load on first use, so that registering the CLI commands imports no web stack.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "create_app": "precache.server.app",
    "LiveServer": "precache.server.live",
    "ServerConfig": "precache.server.config",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'precache.server' has no attribute '{name}'")


__all__ = ["LiveServer", "ServerConfig", "create_app"]
