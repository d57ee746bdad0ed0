"""The cluster's HTTP ingress: the one OpenAI endpoint in front of the replicas.

It tokenizes each generation request's prompt exactly as the replicas will (the same protocol
functions over the same tokenizer), hashes its blocks (:func:`~precache.cluster.routing.block_hashes`)
as routing metadata, and forwards the raw request to a replica through a Ray handle whose router
(:class:`~precache.cluster.router.TrajectoryAffinityRouter`, or Ray's default) picks the replica.
Everything the client sees (routes, validation, errors, streaming) comes from the replica's own
``create_app``; the ingress only relays it.

A replica that dies: a request that had received nothing from it yet is sent again (the router
no longer offers the dead replica), up to ``attempts`` times; a response already under way ends
with an error the client can read (an SSE error event and ``[DONE]`` in a stream).
"""

import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from precache.cluster.replica import ForwardedRequest, ResponseStart
from precache.cluster.routing import block_hashes
from precache.server.codec import Codec
from precache.server.errors import APIError, error_body
from precache.server.prompts import chat_prompt, completion_prompts
from precache.server.protocol import ChatRequest, CompletionRequest
from precache.server.responses import sse
from precache.server.tenants import Tenants

logger = logging.getLogger(__name__)

_REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}

api = FastAPI(title="precache cluster")


class _TokenizerOnly:
    """What :class:`~precache.server.codec.Codec` reads from an engine to encode: its tokenizer and
    context length (tokens)."""

    def __init__(self, tokenizer, max_context: int):
        self.tokenizer, self.max_context = tokenizer, max_context


def routing_codec(tokenizer, max_context: int, trust_special: bool = False) -> Codec:
    """The server's :class:`~precache.server.codec.Codec` over ``tokenizer`` alone (``max_context``
    in tokens; ``trust_special`` as the servers' ``trust_client_special_tokens``)."""
    stub = _TokenizerOnly(tokenizer, max_context)
    return Codec(stub, trust_special) if trust_special else Codec(stub)


def prompt_ids(path: str, body: bytes, codec, vocab_size: int) -> list[int]:
    """Token ids of a generation request's (first) prompt, computed by the server's own protocol
    functions; ``[]`` for any other request or one the replica will refuse (it answers with the
    error). A completions request with several prompts is routed by its first."""
    try:
        if path == "/v1/completions":
            req = CompletionRequest.model_validate(json.loads(body))
            return completion_prompts(req, codec, vocab_size)[0]
        if path == "/v1/chat/completions":
            return chat_prompt(ChatRequest.model_validate(json.loads(body)), codec)
    except (APIError, ValueError):  # a request the replica refuses (it answers with the error)
        return []
    except Exception:  # a bug: route as a new trajectory, but say so
        logger.warning("cannot tokenize a %s request for routing", path, exc_info=True)
    return []


def request_tenant(body: bytes) -> str | None:
    """The tenant a replica's server gives the request (the cluster serves without API keys: its
    ``cache_salt`` alone), so the prompt is hashed in the same chain as that tenant's sessions."""
    try:
        salt = json.loads(body).get("cache_salt")
    except (ValueError, AttributeError):
        return None
    return Tenants.tenant(None, salt if isinstance(salt, str) else None)


async def _until_first_bytes(stream) -> tuple[ResponseStart, list[bytes], bool]:
    """Read ``stream`` until its first body bytes (or its end): ``(start, pieces, ended)``. Nothing
    reaches the client before this returns, so a replica lost meanwhile costs only a retry."""
    start, pieces = None, []
    try:
        async for item in stream:
            if isinstance(item, ResponseStart):
                start = item
                continue
            pieces.append(item)
            return start, pieces, False
    except BaseException:
        stream.cancel()
        raise
    if start is None:
        raise RuntimeError("the replica ended the response without a status")
    return start, pieces, True


async def _relay(stream, first: list[bytes], event_stream: bool) -> AsyncIterator[bytes]:
    """The rest of a response; a replica lost mid-way ends it with an error (SSE: an error event,
    then ``[DONE]``, as the server ends a stream that fails)."""
    finished = False
    try:
        for piece in first:
            yield piece
        async for item in stream:
            yield item
        finished = True
    except _REPLICA_LOST as exc:
        logger.warning("a replica died while streaming a response: %s", exc)
        finished = True
        message = "the replica serving this request died; its caches are lost: send the request again"
        if event_stream:
            yield sse(error_body(503, message, None, "replica_lost")).encode()
            yield sse("[DONE]").encode()
    finally:
        if not finished:
            stream.cancel()  # the client left: the replica's app sees a disconnect


@serve.ingress(api)
class PrecacheIngress:
    """Ray Serve deployment class: ``replicas`` is the handle of the replica deployment;
    ``tokenizer`` the model's (None: token-id prompts only), ``vocab_size`` its vocabulary,
    ``max_context`` its context length (tokens), ``trust_special`` the servers' setting for
    special-token text in messages (the codec must read prompts as they do), ``block_size`` the
    routing block (tokens), ``attempts`` the tries of a request whose replica dies before
    answering."""

    def __init__(
        self,
        replicas,
        tokenizer,
        vocab_size: int,
        max_context: int,
        trust_special: bool,
        block_size: int,
        attempts: int = 3,
    ):
        self.replicas = replicas.options(stream=True)
        self.codec = routing_codec(tokenizer, max_context, trust_special)
        self.vocab_size, self.block_size, self.attempts = vocab_size, block_size, attempts

    @api.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        path = "/" + path
        ids = prompt_ids(path, body, self.codec, self.vocab_size) if request.method == "POST" else []
        forwarded = ForwardedRequest(
            request.method,
            path,
            request.url.query,
            tuple(request.headers.items()),
            body,
            tuple(block_hashes(ids, self.block_size, request_tenant(body) if ids else None)),
        )
        for attempt in range(1, self.attempts + 1):
            stream = self.replicas.handle.remote(forwarded)
            try:
                start, first, done = await _until_first_bytes(stream)
            except _REPLICA_LOST as exc:
                logger.warning("a replica died before answering %s (try %d): %s", path, attempt, exc)
                continue
            headers = {k: v for k, v in start.headers if k not in _HOP_HEADERS}
            if done:
                return Response(b"".join(first), status_code=start.status, headers=headers)
            event_stream = headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(_relay(stream, first, event_stream), start.status, headers)
        message = f"no replica could serve the request: each of {self.attempts} tries lost its replica"
        return JSONResponse(error_body(503, message, None, "unavailable"), status_code=503)
