"""Adapters loaded and unloaded while the server runs: vLLM's ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, served only with ``precache serve --enable-runtime-lora``
(vLLM serves them only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): whoever may call them loads
files from the server's disk.

The engine does the work (:meth:`~precache.engine.engine.Engine.add_adapter`, between two steps);
every trajectory gets the new adapter's caches at its next turn as the sharing method defines them
(DESIGN.md, "Adapters loaded at run time"). Answers as vLLM's: 200 with a plain-text line, or an
error body (400: a bad name, path or adapter, or no room for it; 404: unloading a name not loaded;
409: unloading an adapter a request is using).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from precache.errors import (
    AdapterBusyError,
    AdapterError,
    AdapterLimitError,
    CacheCapacityError,
    UnknownAdapterError,
)
from precache.server.errors import APIError, quote

#: the longest adapter name (it becomes a ``model`` id)
MAX_ADAPTER_NAME_CHARS = 256


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body: ``lora_name`` (the ``model`` id requests will use), ``lora_path`` (a PEFT folder
    on the server's disk) and ``load_inplace`` (replace a loaded adapter of that name: refused)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_path: StrictStr
    load_inplace: StrictBool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body: ``lora_name``; ``lora_int_id`` (vLLM's internal id) is accepted only if absent."""

    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None


def check_name(name: str, base_name: str) -> None:
    """An adapter name a request's ``model`` can carry, not the base model's. Raises APIError 400."""
    if not name.strip() or len(name) > MAX_ADAPTER_NAME_CHARS or not name.isprintable():
        raise APIError(
            400,
            f"lora_name must be 1 to {MAX_ADAPTER_NAME_CHARS} printable characters, got {quote(name)}",
            "lora_name",
            "invalid_value",
        )
    if name == base_name:
        raise APIError(400, f"lora_name {quote(name)} is the base model's name", "lora_name", "invalid_value")


def load(engine, base_name: str, body: LoadLoRAAdapterRequest) -> str:
    """Load ``body.lora_path`` as ``body.lora_name`` (on a worker thread: it reads the disk and
    waits for the step in flight). Returns the success line. Raises APIError 400."""
    check_name(body.lora_name, base_name)
    if body.load_inplace:
        raise APIError(
            400,
            "load_inplace is not supported: unload the adapter, then load the new one",
            "load_inplace",
            "unsupported",
        )
    if body.lora_name in engine.adapters:
        raise APIError(
            400, f"the adapter {quote(body.lora_name)} is loaded already", "lora_name", "adapter_exists"
        )
    try:
        engine.add_adapter(body.lora_name, body.lora_path)
    except (
        CacheCapacityError,
        AdapterLimitError,
    ) as exc:  # the library names its arguments; the server has flags
        raise APIError(
            400,
            f"cannot load {quote(body.lora_name)}: {exc} (precache serve: --max-loras / --max-lora-rank)",
            "lora_name",
            "no_adapter_slot",
        ) from None
    except AdapterError as exc:
        raise APIError(
            400, f"cannot load {quote(body.lora_name)}: {exc}", "lora_path", "invalid_adapter"
        ) from None
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


def unload(loop, body: UnloadLoRAAdapterRequest) -> str:
    """Unload ``body.lora_name`` through the server loop (``loop``: a
    :class:`~precache.server.loop.ServerLoop`, which also knows the requests queued before they
    reach the engine). Returns the success line. Raises APIError 400, 404 or 409."""
    if body.lora_int_id is not None:
        raise APIError(
            400, "lora_int_id is not supported: name the adapter by lora_name", "lora_int_id", "unsupported"
        )
    try:
        loop.remove_adapter(body.lora_name)
    except UnknownAdapterError:
        raise APIError(
            404, f"the adapter {quote(body.lora_name)} is not loaded", "lora_name", "adapter_not_found"
        ) from None
    except AdapterBusyError as exc:
        raise APIError(409, str(exc), "lora_name", "adapter_in_use") from None
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
