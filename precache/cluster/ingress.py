"""The cluster's HTTP ingress: the one OpenAI endpoint in front of the replicas.

It tokenizes each generation request's prompt exactly as the replicas will (the same protocol
functions over the same tokenizer), hashes its blocks (:func:`~precache.cluster.routing.block_hashes`)
as routing metadata, and forwards the raw request to a replica through a Ray handle whose router
(:class:`~precache.cluster.router.TrajectoryAffinityRouter`, or Ray's default) picks the replica.
Everything the client sees (routes, validation, errors, streaming) comes from the replica's own
``create_app``; the ingress only relays it, after the checks one server makes before reading a
body (:class:`~precache.server.guard.Admission`: the API key, 401; the body size, 413). The key
itself never leaves the ingress: a replica gets its fingerprint, which makes the request's tenant
there as on one server, and the router hashes the prompt under that tenant (key and
``cache_salt``), so where a request lands says nothing about other tenants' prompts. ``GET
/metrics`` merges every replica's metrics, each labelled with its replica
(:mod:`precache.cluster.metrics`).

A replica that dies: a request that had received nothing from it yet is sent again (the router
no longer offers the dead replica), up to ``attempts`` times; a response already under way ends
with an error the client can read (an SSE error event and ``[DONE]`` in a stream).
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from precache.cluster.metrics import INGRESS, IngressMetrics, merge_metrics
from precache.cluster.replica import REPLICA_HEADER, ForwardedRequest, ResponseStart
from precache.cluster.routing import block_hashes
from precache.server.config import DEFAULT_MAX_REQUEST_BYTES
from precache.server.errors import APIError, error_body
from precache.server.guard import Admission
from precache.server.prompts import Codec, chat_prompt, completion_prompts
from precache.server.protocol import ChatRequest, CompletionRequest
from precache.server.responses import sse
from precache.server.tenants import Tenants

logger = logging.getLogger(__name__)

_REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}
_NOT_FORWARDED = {"authorization"}  # the key stays here; the replica gets its fingerprint
#: seconds one replica may take to answer the ingress's ``/metrics`` scrape
METRICS_TIMEOUT_S = 10.0

api = FastAPI(title="precache cluster")


class _TokenizerOnly:
    """What :class:`~precache.server.prompts.Codec` reads from an engine to encode: its tokenizer and
    context length (tokens)."""

    def __init__(self, tokenizer, max_context: int):
        self.tokenizer, self.max_context = tokenizer, max_context


def routing_codec(tokenizer, max_context: int, trust_special: bool = False) -> Codec:
    """The server's :class:`~precache.server.prompts.Codec` over ``tokenizer`` alone (``max_context``
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


def request_tenant(key: str | None, body: bytes) -> str | None:
    """The tenant a replica's server gives the request: the fingerprint ``key`` of its API key
    (None: none) and its ``cache_salt``, so the prompt is hashed in the same chain as that tenant's
    sessions."""
    try:
        salt = json.loads(body).get("cache_salt")
    except (ValueError, AttributeError):
        salt = None
    return Tenants.tenant(key, salt if isinstance(salt, str) else None)


async def read_body(chunks: AsyncIterator[bytes], limit: int) -> bytes | None:
    """The body of ``chunks``, or None as soon as it passes ``limit`` bytes (the rest is not read)."""
    pieces, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            return None
        pieces.append(chunk)
    return b"".join(pieces)


def replica_actor_name(app_name: str, deployment: str, replica_id: str) -> str:
    """The Ray actor name of Serve replica ``replica_id`` (namespace ``serve``)."""
    return f"SERVE_REPLICA::{app_name}#{deployment}#{replica_id}"


def replica_names(app_name: str, deployment: str) -> list[str]:
    """The Ray Serve replica ids of ``deployment`` in application ``app_name`` now: the names of
    their actors (``SERVE_REPLICA::<app>#<deployment>#<id>``), read from Ray's actor registry."""
    import ray

    prefix = replica_actor_name(app_name, deployment, "")
    actors = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"].removeprefix(prefix)
        for a in actors
        if a.get("namespace") == "serve" and a["name"].startswith(prefix)
    )


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
        api_keys: tuple[str, ...] = (),
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ):
        self.replicas = replicas.options(stream=True)
        self.codec = routing_codec(tokenizer, max_context, trust_special)
        self.vocab_size, self.block_size, self.attempts = vocab_size, block_size, attempts
        self.admission = Admission(Tenants(api_keys), max_request_bytes)
        self.metrics = IngressMetrics()

    def _refuse(self, status: int, body: dict) -> JSONResponse:
        self.metrics.error(status, body["error"].get("code") or "none")
        return JSONResponse(body, status_code=status)

    @api.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request) -> Response:
        path = "/" + path
        headers = {k.lower(): v for k, v in request.headers.items()}
        key, refusal = self.admission.check(path, headers)
        if refusal is not None:
            return self._refuse(*refusal)
        body = await read_body(request.stream(), self.admission.max_body_bytes)
        if body is None:
            limit = self.admission.max_body_bytes
            return self._refuse(413, self.admission.too_large(f"more than {limit}"))
        if path == "/metrics" and request.method == "GET":
            return await self._metrics()
        ids = prompt_ids(path, body, self.codec, self.vocab_size) if request.method == "POST" else []
        forwarded = ForwardedRequest(
            request.method,
            path,
            request.url.query,
            tuple((k, v) for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED),
            body,
            tuple(block_hashes(ids, self.block_size, request_tenant(key, body) if ids else None)),
            key=key,
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
        return self._refuse(503, error_body(503, message, None, "unavailable"))

    async def _scrape(self, replica: str | None) -> tuple[str, str]:
        """``(replica id, its /metrics text)`` of ``replica`` (None: one the router picks)."""
        stream = self.replicas.handle.remote(ForwardedRequest("GET", "/metrics", replica=replica))
        start, pieces, _ = await _until_first_bytes(stream)
        pieces += [piece async for piece in stream]
        name = dict(start.headers).get(REPLICA_HEADER, replica or "unknown")
        return name, b"".join(pieces).decode()

    async def _metrics(self) -> Response:
        """Every replica's ``/metrics`` merged, each sample labelled with its replica, plus the
        ingress's own; a replica that does not answer within :data:`METRICS_TIMEOUT_S` seconds is
        left out (``precache_cluster_replicas_reporting`` counts the replicas in)."""
        handle = self.replicas
        names = await asyncio.to_thread(replica_names, handle.app_name, handle.deployment_name)
        texts: dict[str, str] = {}
        # one at a time: the calls of one ingress request share its request id, which Ray's router
        # uses to hand a chosen replica to its pending call (two at once: one waits forever)
        for name in names or [None]:
            try:
                replica, text = await asyncio.wait_for(self._scrape(name), METRICS_TIMEOUT_S)
            except (TimeoutError, *_REPLICA_LOST) as exc:
                logger.warning("replica %s: no /metrics: %r", name, exc)
                continue
            texts.setdefault(replica, text)  # asked twice (it replaced a dead one): counted once
        self.metrics.replicas_reporting.set(len(texts))
        return Response(
            merge_metrics({**texts, INGRESS: self.metrics.text()}), media_type=CONTENT_TYPE_LATEST
        )
