"""precache: KV cache sharing for multi-LoRA agent systems (PreLRShared, ReBaseShared)."""

from precache.config import SamplingParams, StructuredOutput
from precache.engine import Engine, EngineConfig, Session, Turn
from precache.errors import (
    AdapterError,
    CacheCapacityError,
    ContextLengthError,
    EmptyRequestError,
    ModelLoadError,
    OutOfBlocksError,
    PrecacheError,
    RequestCancelledError,
    SessionBusyError,
    StructuredOutputError,
    UnknownAdapterError,
    UnknownMethodError,
)
from precache.lora.adapter import LoRAAdapter, load_adapter
from precache.methods import METHODS
from precache.models import load_model

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "AdapterError",
    "CacheCapacityError",
    "ContextLengthError",
    "EmptyRequestError",
    "Engine",
    "EngineConfig",
    "LoRAAdapter",
    "ModelLoadError",
    "OutOfBlocksError",
    "PrecacheError",
    "RequestCancelledError",
    "SamplingParams",
    "Session",
    "SessionBusyError",
    "StructuredOutput",
    "StructuredOutputError",
    "Turn",
    "UnknownAdapterError",
    "UnknownMethodError",
    "load_adapter",
    "load_model",
]
