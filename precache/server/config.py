"""The server's frozen configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024**2  # 4 MiB: far more than any prompt within the context
#: the tool-call formats (:data:`precache.server.tool_parsers.TOOL_PARSERS`; named here so the command
#: line needs no web framework)
TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ServerConfig:
    """How the server batches and caches.

    ``model_name``: the id of the base model in the API (requests for it run without adapter);
    the engine's block pool is the only KV-cache budget (idle sessions are dropped, least recently
    used first, when it needs their blocks). ``max_running``: requests in the batch at once (the
    rest wait). ``max_step_tokens``: prefill tokens per forward (chunked prefill; decode rows are
    always added). ``min_fork_tokens``: shortest shared prefix worth copying into a new session
    (see :class:`~precache.server.sessions.SessionPool`).

    Security (docs/security.md): ``api_keys``: bearer keys a ``/v1`` request must carry (empty:
    no authentication); each key is a tenant of its own. ``max_request_bytes``: the largest request
    body (larger: 413). ``trust_client_special_tokens``: chat message content may spell the chat
    template's control tokens (off: such strings stay text).

    ``runtime_lora``: serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
    (:mod:`precache.server.adapters`; off: those routes do not exist, as in vLLM).

    ``tool_call_parser``: the format of tool calls in the model's answers
    (:data:`~precache.server.tool_parsers.TOOL_PARSERS`: ``hermes``, ``llama3_json``, ``mistral``).

    Slow and stalled clients (docs/security.md): ``stream_buffer_events``: events (tokens,
    turns) a request may have waiting for its client; past it the request is held out of the
    batch (its blocks kept) until the client reads half of them. ``stream_stall_timeout_s``: a
    request held this long is cancelled (everything freed; 408 ``stream_stalled`` to the client
    if it ever reads again). ``max_requests_in_flight``: generation requests admitted at once
    (waiting and running); more get 503 ``server_busy``.
    """

    model_name: str = "base"
    max_running: int = 64
    max_step_tokens: int = 512
    min_fork_tokens: int = 32
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    trust_client_special_tokens: bool = False
    tool_call_parser: str = "hermes"
    runtime_lora: bool = False
    stream_buffer_events: int = 256
    stream_stall_timeout_s: float = 30.0
    max_requests_in_flight: int = 512

    def __post_init__(self):
        if self.max_running < 1 or self.max_step_tokens < 1 or self.min_fork_tokens < 0:
            raise ValueError(f"invalid server configuration: {self}")
        if self.tool_call_parser not in TOOL_PARSER_NAMES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSER_NAMES)}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if (
            self.stream_buffer_events < 2
            or self.stream_stall_timeout_s <= 0
            or self.max_requests_in_flight < 1
        ):
            raise ValueError(
                "stream_buffer_events must be >= 2, stream_stall_timeout_s > 0 and max_requests_in_flight "
                f">= 1, got {self.stream_buffer_events}, {self.stream_stall_timeout_s}, {self.max_requests_in_flight}"
            )
