"""Parallel sampling (``SamplingParams.n > 1``, vLLM's ``n``): the prompt is prefilled once; when
its last chunk ran, the request's session is forked ``n - 1`` times with the turn open (every
cache block shared, copy-on-write), and each fork is a request of its own that samples its first
token from the same logits, then decodes in the same steps as the others."""

from __future__ import annotations

from precache.engine.request import Request


def wants_choices(request: Request) -> bool:
    """The request asks for more choices and has not forked them yet."""
    return request.params.n > 1 and request.parent is None and not request.children


def fork_choices(request: Request) -> list[Request]:
    """Choices ``1..n-1`` of ``request`` (its prompt prefilled, nothing sampled yet), each on a fork
    of its session; they are appended to ``request.children`` and returned."""
    session = request.session
    for index in range(1, request.params.n):
        fork = session.fork_open(len(session.token_ids))
        request.children.append(request.fork(fork, index))
    return request.children
