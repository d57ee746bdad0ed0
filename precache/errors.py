"""Exception types a user can act on.

Every error precache raises on bad input derives from :class:`PrecacheError`, so callers can
catch one type; each message names the offending file, field or value, and ``param`` names the
request field at fault when there is one (the OpenAI server's ``error.param``).
"""

from __future__ import annotations


class PrecacheError(Exception):
    """Base class of every error precache raises on bad input; ``param``: the request field at fault
    (``prompt``, ``max_tokens``, ``stop_token_ids``, ...), or None."""

    def __init__(self, *args, param: str | None = None):
        super().__init__(*args)
        self.param = param


class ModelLoadError(PrecacheError):
    """A model path is missing, malformed or of an unsupported architecture."""


class AdapterError(PrecacheError):
    """A LoRA adapter folder is missing, malformed, unsupported or does not fit the base model."""


class AdapterLimitError(AdapterError):
    """An engine holds ``max_adapters`` adapters already, or an adapter's rank is above ``max_lora_rank``."""


class AdapterBusyError(PrecacheError):
    """An adapter cannot be unloaded while a request of it is waiting or running."""


class UnknownAdapterError(PrecacheError, KeyError):
    """An adapter (agent) name is not loaded."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class TraceError(PrecacheError, ValueError):
    """A trace file is missing or malformed, or does not fit the engine it is replayed on."""


class UnknownMethodError(PrecacheError, ValueError):
    """A sharing method name does not exist."""


class ContextLengthError(PrecacheError, ValueError):
    """A request would run past the model's context length."""


class EmptyRequestError(PrecacheError, ValueError):
    """A request has nothing to process (no tokens, or max_new_tokens < 1)."""


class InvalidParameterError(PrecacheError, ValueError):
    """A sampling parameter this engine cannot honour (a token id outside the vocabulary)."""


class StructuredOutputError(PrecacheError, ValueError):
    """A structured-output constraint (JSON schema, regex, choice, grammar) that does not compile."""


class CacheIntegrityError(PrecacheError, AssertionError):
    """A cache invariant (equal lengths, segment coverage) does not hold: a bug, not bad input."""


class CacheCapacityError(PrecacheError, ValueError):
    """A request needs more KV-cache blocks than the pool can ever hold (raise ``kv_cache_bytes``)."""


class OutOfBlocksError(PrecacheError, RuntimeError):
    """The block pool has no free or evictable block right now (transient: retry when others finish)."""


class RequestCancelledError(PrecacheError):
    """A request was cancelled before it finished; ``turn`` holds the tokens it produced (or None)."""

    def __init__(self, message: str, turn=None):
        super().__init__(message)
        self.turn = turn


class SessionBusyError(PrecacheError, RuntimeError):
    """A session was changed (append, sync, fork) while a turn runs on it."""
