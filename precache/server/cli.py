"""``precache serve``: the OpenAI-compatible server (vLLM-style flags, loopback by default).

The address is bound before the model loads, so a taken port is one line and exit code 2 at once;
"serving on ..." is logged only once the server accepts connections. The scale-out flags
(``--replicas``) are added to this command by :mod:`precache.cluster.cli`; what the flags become
(adapters, keys, the server's configuration) is :mod:`precache.server.args`.
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket

import precache
from precache.cli_args import positive_float, positive_int
from precache.errors import AdapterError, PrecacheError
from precache.methods import METHOD_REGISTRY
from precache.server.args import (
    adapters_from_args,
    add_engine_arguments,
    api_keys_from_args,
    load_model_from_args,
    max_adapters_from_args,
    served_model_name,
    server_config_from_args,
    swap_space_gib,
)
from precache.server.config import DEFAULT_MAX_REQUEST_BYTES, TOOL_PARSER_NAMES

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
    config = server_config_from_args(args, name, api_keys)
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
