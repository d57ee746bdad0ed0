"""What ``precache serve``'s flags become (also read by ``precache serve --replicas`` and ``bench
serve``): the adapters to serve, the adapter budget, the API keys, the model, and the server's
:class:`~precache.server.config.ServerConfig`; each checked before any model loads."""

from __future__ import annotations

import argparse
from pathlib import Path

import precache
from precache.cli_args import add_dtype_argument, model_options
from precache.errors import AdapterError
from precache.resources import adapter_set
from precache.server.config import ServerConfig
from precache.server.tenants import APIKeyError, read_api_keys


def lora_module(item: str) -> tuple[str, str]:
    """``"plan=DIR"`` -> ``("plan", "DIR")`` (an argparse ``type``).

    Raises:
        argparse.ArgumentTypeError: not ``NAME=DIR``.
    """
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"takes NAME=DIR, got {item!r}")
    return name, path


def swap_space_gib(text: str) -> int:
    """An ``argparse`` ``type``: host swap space in GiB (vLLM's ``--swap-space``), returned in bytes.

    Raises:
        argparse.ArgumentTypeError: not a finite number >= 0.
    """
    try:
        gib = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of GiB, got {text!r}") from None
    if not 0 <= gib < float("inf"):
        raise argparse.ArgumentTypeError(f"takes a number of GiB >= 0, got {text!r}")
    return int(gib * 2**30)


def adapters_from_args(args: argparse.Namespace) -> dict[str, str]:
    """``--adapters`` (a committed set or a folder of adapters, serve only) and ``--lora-modules``
    as ``{name: folder}``, checked before any model loads.

    Raises:
        AdapterError: a name is given twice, or a folder holds no ``adapter_config.json``.
    """
    out: dict[str, str] = {}
    if getattr(args, "adapter_set", None):  # serve --adapters NAME|DIR: every adapter of the set
        out = {name: str(path) for name, path in adapter_set(args.adapter_set).items()}
    from_set = set(out)
    for name, path in args.lora_modules:
        if name in from_set:
            raise AdapterError(f"--lora-modules names the adapter '{name}', which --adapters already serves")
        if name in out:
            raise AdapterError(f"--lora-modules names the adapter '{name}' twice")
        out[name] = path
    for name, path in out.items():
        if not (Path(path).expanduser() / "adapter_config.json").is_file():
            raise AdapterError(f"--lora-modules {name}={path}: no PEFT adapter (adapter_config.json) there")
    return out


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--lora-modules``, ``--dtype``, ``--device`` (shared with ``bench serve``)."""
    parser.add_argument(
        "--model", default=None, help="HF checkpoint folder or .gguf (default: embedded SmolLM2)"
    )
    parser.add_argument(
        "--lora-modules",
        nargs="*",
        type=lora_module,
        default=[],
        metavar="NAME=DIR",
        help="adapters by agent name",
    )
    add_dtype_argument(parser)
    parser.add_argument("--device", default=None, help="torch device, e.g. cuda (default: CPU)")


def load_model_from_args(args: argparse.Namespace):
    """The model of ``--model/--dtype/--device`` (raises ModelLoadError)."""
    return precache.load_model(args.model, **model_options(args), device=args.device)


def served_model_name(args: argparse.Namespace, model) -> str:
    """``--served-model-name``, else the checkpoint's name (a converted GGUF's source name, an HF
    folder's name), else ``base``."""
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    name = getattr(getattr(model, "config", None), "name", "") or getattr(model, "path", "")
    return Path(name).name if name else "base"


#: spare adapters ``--enable-runtime-lora`` makes room for when ``--max-loras`` is not given
RUNTIME_LORA_SPARE = 4


def max_adapters_from_args(args: argparse.Namespace, n_given: int) -> int | None:
    """``--max-loras``, else room for :data:`RUNTIME_LORA_SPARE` more with ``--enable-runtime-lora``.

    Raises:
        AdapterError: ``--max-loras`` or ``--max-lora-rank`` without ``--enable-runtime-lora``
            (no adapter could be loaded later: the flag would change nothing).
    """
    given = [f for f, v in (("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank)) if v]
    if given and not args.enable_runtime_lora:
        raise AdapterError(
            f"{', '.join(given)}: only with --enable-runtime-lora (adapters loaded at run time)"
        )
    if args.max_loras is not None:
        return args.max_loras
    return n_given + RUNTIME_LORA_SPARE if args.enable_runtime_lora else None


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """``--api-key`` (repeatable) and the keys of ``--api-keys FILE``, in order, without repeats.

    Raises:
        APIKeyError: the file cannot be read or holds no key; a key is empty.
    """
    keys = list(getattr(args, "api_key", None) or [])
    if getattr(args, "api_keys", None):
        keys += read_api_keys(args.api_keys)
    if any(not k.strip() for k in keys):
        raise APIKeyError("--api-key: a key is empty")
    return tuple(dict.fromkeys(k.strip() for k in keys))


def server_config_from_args(
    args: argparse.Namespace, model_name: str, api_keys: tuple[str, ...]
) -> ServerConfig:
    """The :class:`~precache.server.config.ServerConfig` of ``precache serve``'s flags, serving the
    base model as ``model_name`` and requiring ``api_keys`` (:func:`api_keys_from_args`, read once
    by the caller so a bad key file fails before the model loads).

    Raises:
        ValueError: a setting out of range (:class:`~precache.server.config.ServerConfig`).
    """
    return ServerConfig(
        model_name=model_name,
        max_running=args.max_num_seqs,
        max_step_tokens=args.max_num_batched_tokens,
        api_keys=api_keys,
        max_request_bytes=args.max_request_bytes,
        trust_client_special_tokens=args.trust_client_special_tokens,
        tool_call_parser=args.tool_call_parser,
        runtime_lora=args.enable_runtime_lora,
        stream_buffer_events=args.stream_buffer_events,
        stream_stall_timeout_s=args.stream_stall_timeout,
        max_requests_in_flight=args.max_requests_in_flight,
    )
