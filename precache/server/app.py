"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streamed as server-sent events or not), ``/health`` and ``/metrics``.

The ``model`` field chooses the adapter: the base model's name runs without one, an adapter's
name runs that agent. Handlers validate and tokenise off the event loop (a thread pool: /health
answers while a large request is checked), queue a :class:`~precache.server.jobs.Job` on the server
loop (:class:`~precache.server.loop.ServerLoop`, which steps the engine) and relay its events.
In front of the routes, :class:`~precache.server.guard.Guard` checks the API key and the body size;
each request runs for its tenant (:mod:`precache.server.tenants`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from precache.engine.outputs import StreamChunk, Turn
from precache.engine.structured import check_structured_output
from precache.errors import StructuredOutputError
from precache.server import adapters as runtime_adapters
from precache.server.access import STATE_KEY as ACCESS_STATE_KEY
from precache.server.access import AccessLog
from precache.server.adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from precache.server.config import ServerConfig
from precache.server.errors import APIError, error_body, install_error_handlers, quote, refuse
from precache.server.guard import KEY_SCOPE, Guard
from precache.server.jobs import ErrorEvent, Job, JobGroup
from precache.server.loop import ServerLoop
from precache.server.metrics import ServerMetrics
from precache.server.prompts import Codec, chat_prompt, completion_prompts, echo_text
from precache.server.protocol import (
    ChatRequest,
    CompletionRequest,
    check_fields,
    check_unicode,
    checked_params,
)
from precache.server.responses import Renderer, sse
from precache.server.shapes import STRUCTURED_FIELDS
from precache.server.tenants import Tenants
from precache.server.tool_parsers import get_parser
from precache.server.tools import tool_constraint, tool_request

logger = logging.getLogger(__name__)


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """The API over ``engine`` (an :class:`~precache.engine.engine.Engine`). The server loop's thread
    starts and stops with the app's lifespan; it is ``app.state.loop``.

    Raises:
        ValueError: an adapter is named like the base model.
    """
    config = config or ServerConfig()
    if config.model_name in engine.adapters:
        raise ValueError(f"the base model name '{config.model_name}' is also an adapter name")
    codec, metrics = Codec(engine, config.trust_client_special_tokens), ServerMetrics()
    scheduler = ServerLoop(engine, config, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="precache", lifespan=lifespan)
    app.state.loop, app.state.engine, app.state.config = scheduler, engine, config
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(
        Guard, tenants=Tenants(config.api_keys), max_body_bytes=config.max_request_bytes, metrics=metrics
    )
    app.add_middleware(AccessLog)  # outermost: refusals by the guard get their line too
    _add_routes(app, _Api(engine, config, codec, scheduler, metrics), metrics)
    return app


def _add_routes(app: FastAPI, api: _Api, metrics: ServerMetrics) -> None:
    engine, scheduler, codec = api.engine, api.scheduler, api.codec

    @app.get("/health")
    async def health():
        if scheduler.draining:
            return JSONResponse(
                {"status": "draining", **error_body(503, "the server is shutting down", None, "draining")},
                status_code=503,
            )
        if not scheduler.alive:
            return JSONResponse(error_body(503, "the server loop is not running"), status_code=503)
        return {"status": "ok", "method": engine.method_name}

    @app.get("/metrics")
    async def prometheus_metrics():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    if api.config.runtime_lora:  # vLLM's routes, as vLLM: only when asked for

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            text = await run_in_threadpool(runtime_adapters.load, engine, api.config.model_name, body)
            return PlainTextResponse(text)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            return PlainTextResponse(await run_in_threadpool(runtime_adapters.unload, scheduler, body))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": api.model_cards()}

    vocab = engine.model.config.vocab_size

    def completion_ids(body: CompletionRequest, tools: None) -> list[list[int]]:
        return completion_prompts(body, codec, vocab)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        group, renderer = await run_in_threadpool(
            api.prepare, body, request.scope.get(KEY_SCOPE), completion_ids, "completion"
        )
        return await api.generate(request, body, group, renderer)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        group, renderer = await run_in_threadpool(
            api.prepare,
            body,
            request.scope.get(KEY_SCOPE),
            lambda b, tools: [chat_prompt(b, codec, api.tool_parser, tools)],
            "chat",
        )
        return await api.generate(request, body, group, renderer)


class _Api:
    """What the routes share: model lookup, queuing, and relaying the scheduler's events."""

    def __init__(
        self, engine, config: ServerConfig, codec: Codec, scheduler: ServerLoop, metrics: ServerMetrics
    ):
        self.engine, self.config, self.codec, self.scheduler = engine, config, codec, scheduler
        self.metrics = metrics
        self.tool_parser = get_parser(config.tool_call_parser)
        self.created = int(time.time())

    def model_cards(self) -> list[dict]:
        base = self.config.model_name
        card = {"object": "model", "created": self.created, "owned_by": "precache"}
        ctx = {"max_model_len": self.engine.max_context}
        out = [{"id": base, **card, "root": base, "parent": None, **ctx}]
        out += [
            {"id": name, **card, "root": base, "parent": base, **ctx} for name in list(self.engine.adapters)
        ]
        return out

    def agent(self, model: str) -> str | None:
        """The adapter a ``model`` field names (None: the base model). Raises APIError 404."""
        if model == self.config.model_name:
            return None
        if model in self.engine.adapters:
            return model
        known = ", ".join([self.config.model_name, *self.engine.adapters])
        raise APIError(
            404, f"the model {quote(model)} does not exist (models: {known})", "model", "model_not_found"
        )

    def prepare(self, body, key: str | None, prompt_ids, kind: str) -> tuple[JobGroup, Renderer]:
        """Validate ``body`` and tokenise its prompts (``prompt_ids(body, tools)``: one list of token
        ids per prompt; ``tools``: a chat request's :class:`~precache.server.tools.ToolRequest`,
        shown in the prompt, forced by a constraint when required and parsed out of the answer) on
        a worker thread: one job per prompt (for the tenant of ``key`` and ``body.cache_salt``) and
        the response's renderer.

        Raises:
            APIError: 4xx, the request is refused (nothing was queued).
        """
        # first: error messages may quote fields
        check_unicode(body.model_dump(exclude_unset=True, by_alias=True))
        agent = self.agent(body.model)
        check_fields(body)  # the field policy before any tokenising
        tools = (
            tool_request(body.tools, body.tool_choice, body.parallel_tool_calls) if kind == "chat" else None
        )
        prompts = prompt_ids(body, tools)
        params = checked_params(body, prompts, self.engine.max_context, self.engine.model.config.vocab_size)
        constraint = tool_constraint(tools, self.tool_parser) if tools is not None else None
        if constraint is not None and params.structured_output is not None:
            raise refuse(
                "tool_choice",
                "a required or named tool call cannot be combined with a structured-output constraint",
                "invalid_value",
            )
        if constraint is not None:
            params = dataclasses.replace(params, structured_output=constraint)
        if params.structured_output is not None:  # compiled before anything is queued or sent
            try:
                check_structured_output(self.engine, params.structured_output)
            except StructuredOutputError as exc:
                field = "tool_choice" if constraint is not None else _structured_field(body)
                raise refuse(field, str(exc), "invalid_value") from None
        tenant = Tenants.tenant(key, body.cache_salt)
        group = JobGroup(
            [
                Job(agent, ids, params, body.model, body.session_id, tenant=tenant, stream=bool(body.stream))
                for ids in prompts
            ]
        )
        ids = prompts[0]
        renderer = Renderer(
            kind,
            body.model,
            ids,
            self.codec,
            return_token_ids=body.return_token_ids,
            tokens_as_ids=bool(body.return_tokens_as_token_ids),
            echo=echo_text(body, ids, self.codec),
            request_id=body.request_id,
            choices_per_prompt=params.n,
            tool_parser=self.tool_parser if tools is not None else None,
            tools=tools,
        )
        return group, renderer

    async def generate(self, request: Request, body, job: JobGroup, renderer: Renderer):
        """Queue the request's jobs on the server loop and answer: a stream, or the whole response.

        Raises:
            APIError: 503 while the server drains (``draining``) or with
            ``max_requests_in_flight`` generation requests admitted already (``server_busy``).
        """
        if self.scheduler.draining:
            self.metrics.refused.labels("draining").inc()
            raise APIError(503, "the server is shutting down", code="draining")
        in_flight = self.scheduler.in_flight
        if in_flight + len(job.jobs) > self.config.max_requests_in_flight:
            self.metrics.refused.labels("max_requests_in_flight").inc()
            raise APIError(
                503,
                f"{in_flight} requests are in flight, the limit is {self.config.max_requests_in_flight} "
                "(--max-requests-in-flight): retry later",
                code="server_busy",
            )
        job.bind(asyncio.get_running_loop())
        setattr(request.state, ACCESS_STATE_KEY, job)  # its access-log line
        for one in job.jobs:
            self.scheduler.submit(one)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._stream(job, renderer, usage), media_type="text/event-stream")
        return await self._complete(job, renderer, request)

    def _cancel(self, job: JobGroup) -> None:
        for one in job.jobs:
            self.scheduler.cancel(one.id)

    async def _stream(self, job: JobGroup, renderer: Renderer, include_usage: bool):
        """SSE chunks in the OpenAI format, then ``data: [DONE]``. A chunk goes out when a token
        makes text safe to send, with the log-probabilities of every token since the last chunk.
        A client that leaves cancels the job (Starlette cancels this generator when the connection
        drops)."""
        wants_logprobs = job.params.logprobs is not None
        pending: dict[int, list] = {i: [] for i in range(job.n)}
        turns: dict[int, Turn] = {}
        over = False
        try:
            for first in renderer.first_chunks(job.n):
                yield sse(first)
            async for event in job.events():
                if isinstance(event, StreamChunk):
                    if event.logprob is not None:
                        pending[event.index].append(event.logprob)
                    if event.text:
                        entries = pending[event.index] if wants_logprobs else None
                        piece = renderer.chunk(event.index, event.text, entries)
                        if piece is not None:  # None: held back until the answer is whole
                            yield sse(piece)
                            pending[event.index] = []
                elif isinstance(event, Turn):
                    turns[event.index] = event
                    entries = pending[event.index] if wants_logprobs else None
                    yield sse(renderer.last_chunk(event.index, event, entries))
                else:
                    over = True
                    self._cancel(job)  # the request's other prompts, if any, stop too
                    self.metrics.error(event.status, event.code)
                    yield sse(error_body(event.status, event.message, None, event.code))
                    break
            else:
                over = True
                if include_usage:
                    yield sse(renderer.usage_chunk([turns[i] for i in range(job.n)]))
            yield sse("[DONE]")
        finally:
            if not over:
                self._cancel(job)

    async def _complete(self, job: JobGroup, renderer: Renderer, request: Request):
        """Wait for every choice; a client that leaves first cancels the job."""

        async def collect() -> list[Turn] | ErrorEvent:
            turns: dict[int, Turn] = {}
            async for event in job.events():
                if isinstance(event, ErrorEvent):
                    return event
                if isinstance(event, Turn):
                    turns[event.index] = event
            return [turns[i] for i in range(job.n)]

        result, left = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({result, left}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            result.cancel()
            self._cancel(job)
            return Response(status_code=499)  # nobody reads it: the client closed the connection
        left.cancel()
        final = result.result()
        if isinstance(final, ErrorEvent):
            self._cancel(job)  # the request's other prompts, if any, stop too
            raise APIError(final.status, final.message, code=final.code)
        return renderer.body(final)


def _structured_field(body) -> str:
    """The request field that carries its structured-output constraint."""
    return next(f for f in STRUCTURED_FIELDS if getattr(body, f, None) is not None)


async def _disconnected(request: Request) -> None:
    """Return once the client closes the connection (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
