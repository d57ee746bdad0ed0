"""Parallel sampling (``SamplingParams.n > 1``, vLLM's ``n``): the prompt is prefilled once; when
its last chunk ran, the request's session is forked ``n - 1`` times with the turn open (every
cache block shared, copy-on-write), and each fork is a request of its own that samples its first
token from the same logits, then decodes in the same steps as the others."""

from __future__ import annotations

from precache.engine.request import Request
from precache.engine.rows import RunningSet


class ParallelSampling:
    """The choice groups of one engine: a request with ``n > 1`` is the group's choice 0, its forks
    (``request.children``) choices ``1..n-1``, which join ``running`` as they are forked."""

    def __init__(self, running: RunningSet):
        self.running = running

    def sample_choices(self, request: Request, logits) -> None:
        """Fork ``request``'s choices ``1..n-1`` now, if it asks for ``n > 1`` and has not forked
        them yet (call it once its prompt's last chunk ran, before it samples): each joins
        ``running`` and samples its first token from ``logits`` (``[vocab]``), the request's own."""
        if not wants_choices(request):
            return
        session = request.session
        for index in range(1, request.params.n):
            fork = session.fork_open(len(session.token_ids))
            request.children.append(Request.choice(request, fork, index))
        for child in request.children:
            self.running.add(child)
            child.sample(logits)


def wants_choices(request: Request) -> bool:
    """The request asks for more choices and has not forked them yet."""
    return request.params.n > 1 and request.parent is None and not request.children
