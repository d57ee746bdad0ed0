"""Slow and stalled clients (issue 24): a stream whose reader stops is held out of the batch with
its blocks kept and cancelled after the stall timeout, freeing everything, and a reader that comes
back gets the same tokens as the request run alone; connections that send their headers or body
too slowly get 408 and are closed; connections past the cap get 503; requests past the in-flight
cap get 503 ``server_busy``; each refusal is counted in ``/metrics``."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from precache.config import SamplingParams
from precache.server import LiveServer, ServerConfig, create_app
from precache.server.connections import ConnectionLimits
from precache.server.jobs import ErrorEvent, Job
from tests.test_server_support import BASE, tiny_engine, wait_idle

PROMPT = [3, 4, 5, 6]
LONG = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)


@pytest.fixture
def event_loop_thread():
    """An asyncio loop running in a thread: where a job's events land (nobody reads them)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _events(loop, job) -> list:
    return asyncio.run_coroutine_threadsafe(_snapshot(job), loop).result(10)


async def _snapshot(job):
    return list(job.queue._queue)


def _alone(tiny) -> list[int]:
    """The greedy tokens of the request run alone on a fresh engine."""
    session = tiny_engine(tiny, "prelrshared").session()
    session.append(PROMPT)
    return session.generate(
        agent="plan", max_new_tokens=LONG.max_new_tokens, temperature=0.0, ignore_eos=True
    ).token_ids


def test_a_stalled_reader_is_held_then_cancelled_and_frees_everything(tiny, event_loop_thread):
    engine = tiny_engine(tiny, "prelrshared")
    app = create_app(
        engine, ServerConfig(model_name=BASE, stream_buffer_events=8, stream_stall_timeout_s=1.0)
    )
    free_before = engine.method.pool.allocator.num_available
    with LiveServer(app) as server:
        scheduler = app.state.loop
        job = Job("plan", PROMPT, LONG, "plan", stream=True).bind(event_loop_thread)
        scheduler.submit(job)
        deadline = time.monotonic() + 30
        while job.flow.held_since is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.flow.held_since is not None and job.request.held
        assert _metric(server.url, "precache_held_requests") == 1
        emitted = job.flow.emitted
        time.sleep(0.3)
        assert job.flow.emitted == emitted  # held: no more rows, no more events
        assert 8 <= emitted < 8 + 4
        wait_idle(server, timeout_s=10)  # the stall timeout cancels it; the turn closes
        events = _events(event_loop_thread, job)
        assert isinstance(events[-1], ErrorEvent) and events[-1].status == 408
        assert events[-1].code == "stream_stalled"
        assert _metric(server.url, 'precache_refused_total{reason="stream_stalled"}') == 1
        assert _metric(server.url, "precache_held_requests") == 0
        # the session's blocks stay cached (an idle conversation); dropping it frees every block
        scheduler.call(lambda pool: pool.reclaim(10**9)).result(10)
        assert engine.method.pool.allocator.num_available == free_before


def test_a_reader_that_comes_back_gets_the_tokens_of_the_request_alone(tiny, event_loop_thread):
    engine = tiny_engine(tiny, "prelrshared")
    app = create_app(engine, ServerConfig(model_name=BASE, stream_buffer_events=8, stream_stall_timeout_s=30))
    with LiveServer(app) as server:
        job = Job("plan", PROMPT, LONG, "plan", stream=True).bind(event_loop_thread)
        app.state.loop.submit(job)
        deadline = time.monotonic() + 30
        while job.flow.held_since is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.request.held

        async def read_all():
            tokens = []
            while True:
                event = await job.queue.get()
                job.flow.taken += 1
                if hasattr(event, "token_id"):
                    tokens.append(event.token_id)
                if not hasattr(event, "token_id"):
                    return tokens, event

        tokens, last = asyncio.run_coroutine_threadsafe(read_all(), event_loop_thread).result(60)
        assert not isinstance(last, ErrorEvent) and last.token_ids == tokens
        wait_idle(server)
    assert tokens == _alone(tiny)


def _conn(server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


def test_slow_headers_and_bodies_get_408_and_extra_connections_503(tiny):
    engine = tiny_engine(tiny, "prelrshared")
    app = create_app(engine, ServerConfig(model_name=BASE))
    limits = ConnectionLimits(max_connections=3, header_timeout_s=0.5, body_timeout_s=0.5)
    with LiveServer(app, limits=limits) as server:
        slow_headers = _conn(server)
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # never finished
        slow_body = _conn(server)
        slow_body.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model": '
        )
        third = _conn(server)
        time.sleep(0.1)
        fourth = _conn(server)
        assert _read_all(fourth).startswith(b"HTTP/1.1 503")
        t0 = time.monotonic()
        assert _read_all(slow_headers).startswith(b"HTTP/1.1 408")
        assert _read_all(slow_body).startswith(b"HTTP/1.1 408")
        assert _read_all(third).startswith(b"HTTP/1.1 408")  # idle: no request within the header time
        assert time.monotonic() - t0 < 5
        for s in (slow_headers, slow_body, third, fourth):
            s.close()
        # a well-behaved client on a keep-alive connection is not cut
        with httpx.Client(timeout=30) as client:
            for _ in range(2):
                r = client.post(
                    server.url + "/completions", json={"model": "plan", "prompt": PROMPT, "max_tokens": 2}
                )
                assert r.status_code == 200
        assert _metric(server.url, 'precache_refused_total{reason="max_connections"}') == 1
        assert _metric(server.url, 'precache_refused_total{reason="header_timeout"}') == 2
        assert _metric(server.url, 'precache_refused_total{reason="body_timeout"}') == 1


def test_requests_past_the_in_flight_cap_get_503(tiny):
    engine = tiny_engine(tiny, "prelrshared")
    step = engine.step
    engine.step = lambda: (threading.Event().wait(0.02), step())[1]
    app = create_app(engine, ServerConfig(model_name=BASE, max_requests_in_flight=1))
    with LiveServer(app) as server:
        body = {"model": "plan", "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True}
        first = threading.Thread(
            target=httpx.post, args=(server.url + "/completions",), kwargs={"json": body, "timeout": 60}
        )
        first.start()
        deadline = time.monotonic() + 10
        while app.state.loop.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = httpx.post(server.url + "/completions", json=body, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_busy"
        first.join(60)
        assert app.state.loop.in_flight == 0
        assert (
            httpx.post(server.url + "/completions", json={**body, "max_tokens": 2}, timeout=30).status_code
            == 200
        )
        assert _metric(server.url, 'precache_refused_total{reason="max_requests_in_flight"}') == 1
