"""``precache serve``: the OpenAI-compatible server (vLLM-style flags, loopback by default).

The address is bound before the model loads, so a taken port is one line and exit code 2 at once;
"serving on ..." is logged only once the server accepts connections. The scale-out flags
(``--replicas``) are added to this command by :mod:`precache.cluster.cli`.
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
from pathlib import Path

import precache
from precache.cli_args import add_dtype_argument, model_options, positive_float, positive_int
from precache.errors import AdapterError, PrecacheError
from precache.methods import METHOD_REGISTRY
from precache.resources import adapter_set
from precache.server.config import DEFAULT_MAX_REQUEST_BYTES, TOOL_PARSER_NAMES, ServerConfig
from precache.server.tenants import APIKeyError, read_api_keys

logger = logging.getLogger(__name__)


class RemovedOption(argparse.Action):
    """``--max-cache-bytes``: refused by name. The block pool is the server's only KV-cache budget
    (idle sessions are dropped, least recently used first, when the engine needs their blocks)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(
            f"{option_string} is gone: the KV block pool is the only cache budget "
            "(idle sessions are dropped when it needs their blocks); use --kv-cache-bytes"
        )


class BindError(PrecacheError):
    """``--host``/``--port`` cannot be bound (taken, not an address of this machine, no permission)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``SO_REUSEADDR``, as uvicorn binds), not yet listening.

    Raises:
        BindError: the address does not resolve or cannot be bound; the message names it and the
            operating system's reason.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise BindError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = " (another server listens there: pass another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise BindError(f"cannot bind {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock


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


def serve(args: argparse.Namespace) -> int:
    """``precache serve`` in this process: bind, load the model, run uvicorn until interrupted."""
    # the web stack: loaded only when a server runs (the CLI's parser and the core do not need it)
    from precache.server.app import create_app
    from precache.server.connections import ConnectionLimits
    from precache.server.live import DrainingServer

    adapters = adapters_from_args(args)
    max_adapters = max_adapters_from_args(args, len(adapters))  # checked before anything loads
    api_keys = api_keys_from_args(args)
    sock = bind_socket(args.host, args.port)
    model = load_model_from_args(args)
    name = served_model_name(args, model)
    if name in adapters:
        raise AdapterError(
            f"--lora-modules {name}=...: the adapter is named like the base model '{name}' "
            "(rename it, or pass --served-model-name)"
        )
    engine = precache.Engine(
        model,
        adapters=adapters,
        method=args.method,
        kv_cache_bytes=args.kv_cache_bytes,
        swap_space_bytes=args.swap_space,
        max_adapters=max_adapters,
        max_lora_rank=args.max_lora_rank,
    )
    engine.compile_decode_step()  # before the socket serves: no request waits for a compile
    config = ServerConfig(
        model_name=name,
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
    banner = (
        f"serving {config.model_name} ({engine.method_name}, adapters: {', '.join(adapters) or 'none'}) "
        f"on http://{args.host}:{args.port}/v1"
    )

    # uvicorn's own INFO lines (startup, access log) with -v only
    log_level = "info" if getattr(args, "verbose", 0) else "warning"
    app = create_app(engine, config)
    limits = ConnectionLimits(args.max_connections, args.header_timeout, args.body_timeout)
    DrainingServer(
        app, args.host, args.port, args.shutdown_timeout, limits, log_level=log_level, banner=banner
    ).run(sockets=[sock])
    return 0


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


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``precache serve`` (single process; :mod:`precache.cluster.cli` adds ``--replicas``)."""
    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and prefix reuse")
    add_engine_arguments(p)
    p.add_argument(
        "--adapters",
        dest="adapter_set",
        default=None,
        metavar="NAME|DIR",
        help="serve every adapter of a committed set (qv, all) or of DIR/<agent>/ (with --lora-modules: both)",
    )
    p.add_argument("--method", default="prelrshared", choices=METHOD_REGISTRY.choices)
    p.add_argument("--served-model-name", default=None, help="API id of the base model")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="KV block pool, allocated once (default: n_agents + 2 caches at the context length)",
    )
    p.add_argument(
        "--swap-space",
        type=swap_space_gib,
        default=None,
        metavar="GIB",
        help="host memory for caches swapped out of the pool, in GiB; past it the least recently "
        "used idle conversations are dropped and recomputed on return (default: a quarter of RAM)",
    )
    p.add_argument("--max-cache-bytes", action=RemovedOption, help=argparse.SUPPRESS)
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests batched at once")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 (repeatable; each key is a tenant of its own)",
    )
    p.add_argument("--api-keys", default=None, metavar="FILE", help="API keys, one per line (as --api-key)")
    p.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"largest request body; larger gets 413 (default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    p.add_argument(
        "--trust-client-special-tokens",
        action="store_true",
        help="let chat message content spell the template's control tokens (default: they stay text)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSER_NAMES,
        default="hermes",
        help="format of tool calls in the model's answers (vLLM's flag; default hermes: "
        "<tool_call>{json}</tool_call>)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM drains for (/health says draining, new requests get 503, running ones "
        "finish); then open streams get an error event and [DONE], waiting responses a 503 (default 30)",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=1024,
        help="open connections at once (more: 503; default 1024)",
    )
    p.add_argument(
        "--header-timeout",
        type=positive_float,
        default=10.0,
        help="seconds a connection may take to send a request's headers (then 408, closed; default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a request may take to send its body after its headers (default 30)",
    )
    p.add_argument(
        "--max-requests-in-flight",
        type=positive_int,
        default=512,
        help="generation requests admitted at once, waiting or running (more: 503 server_busy; default 512)",
    )
    p.add_argument(
        "--stream-buffer-events",
        type=positive_int,
        default=256,
        help="tokens a request may have waiting for a slow reader before it is held out of the batch (default 256)",
    )
    p.add_argument(
        "--stream-stall-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a request stays held for a reader that stopped reading before it is cancelled (default 30)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="prefill tokens per forward")
    p.add_argument(
        "--enable-runtime-lora",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): whoever can call them loads folders from this machine's disk",
    )
    p.add_argument(
        "--max-loras",
        type=positive_int,
        default=None,
        help="adapters loaded at once, counting those loaded at run time (default: the ones given, "
        "or 4 more with --enable-runtime-lora); split methods reserve LR-cache columns for each",
    )
    p.add_argument(
        "--max-lora-rank",
        type=positive_int,
        default=None,
        help="largest rank of an adapter loaded at run time (default: 16 or the largest given)",
    )
    p.set_defaults(func=serve)
