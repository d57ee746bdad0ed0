"""A session: one shared trajectory, its caches, and the agents' turns on it.

A session is a thin client of its engine's scheduler: :meth:`Session.generate`, :meth:`stream`
and :meth:`teacher_force` submit a :class:`~precache.engine.request.Request` and wait while the
engine steps (:meth:`Engine.step`), so turns of several sessions share forwards.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Unpack

from precache.cache.prefix import common_prefix
from precache.cache.swap import SwappedBlocks
from precache.config import SamplingOptions, SamplingParams
from precache.engine.outputs import StreamChunk, Turn
from precache.engine.request import Request
from precache.engine.structured import check_structured_output
from precache.engine.validation import check_adapter, check_room, check_token_ids, params_from_options
from precache.errors import ContextLengthError, EmptyRequestError, SessionBusyError


@dataclass(eq=False)
class Session:
    """One trajectory shared by all agents of an :class:`~precache.engine.engine.Engine`.

    ``token_ids`` is the whole trajectory; ``authors[t]`` the agent whose forward processed token
    t first (DESIGN.md, Notation; None: the base model, or a token whose cache blocks came from
    another trajectory with the same prefix). The caches live in ``state`` (:mod:`precache.methods`).
    ``id`` names the trajectory (the server's ``session_id``); ``active``: the request whose turn
    runs on it (None between turns); ``last_turn_end``: the trajectory length when the latest turn
    closed (what was appended since is the next turn's :attr:`Turn.appended`). ``cache_salt``: the
    tenant (None: the default one); the trajectory reuses and publishes cache blocks by token prefix
    only among trajectories with the same salt (:mod:`precache.cache.prefix`), and its forks keep it.
    ``swapped``: the host copies of its caches while the engine has swapped them out; ``dropped``:
    the engine's swap space dropped them (:mod:`precache.engine.swap_space`), only the tokens and
    authors are kept, and the next request rebuilds the caches from them. Only the session writes
    these fields: the request reports through :meth:`start_turn` ... :meth:`release_turn`, the
    swap space through :meth:`note_swapped` and :meth:`note_rebuilt`.
    """

    engine: object
    token_ids: list[int] = field(default_factory=list)
    authors: list[str | None] = field(default_factory=list)
    state: object = field(default=None, repr=False)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    peak_bytes: int = 0
    last_turn: Turn | None = field(default=None, repr=False)
    last_turn_end: int = 0
    active: Request | None = field(default=None, repr=False)
    cache_salt: str | None = None
    swapped: SwappedBlocks | None = field(default=None, repr=False)
    dropped: bool = False
    last_used: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.method = self.engine.method
        if self.state is None:
            self.state = self.method.new_state()
            self.state.salt = self.cache_salt
        self.engine.scheduler.track(self)

    def __len__(self) -> int:
        return len(self.token_ids)

    # -- the trajectory ------------------------------------------------------------------------
    def append(self, content: str | list[int]) -> int:
        """Append text (tokenised without special tokens) or token ids; return how many tokens.

        Raises:
            ContextLengthError: the trajectory would pass the model's context length (nothing appended).
            SessionBusyError: a turn runs on this session.
        """
        self._check_idle("append to")
        ids = self.engine.encode(content) if isinstance(content, str) else [int(t) for t in content]
        if len(self.token_ids) + len(ids) > self.engine.max_context:
            raise ContextLengthError(
                f"appending {len(ids)} tokens to a {len(self.token_ids)}-token trajectory passes the "
                f"context length of {self.engine.max_context}"
            )
        self.token_ids.extend(ids)
        return len(ids)

    def sync(self, token_ids: list[int]) -> int:
        """Make the trajectory equal ``token_ids``, cutting every cache back to the common prefix
        (DESIGN.md fact 6). Returns the common prefix length.

        Raises:
            ContextLengthError: ``token_ids`` passes the context length (the caches are already cut).
            SessionBusyError: a turn runs on this session.
        """
        self._check_idle("sync")
        self._resident()
        common = common_prefix(self.token_ids, token_ids)
        if common < len(self.token_ids):
            self.method.truncate(self.state, common)  # a dropped session's caches are empty already
            del self.authors[common:]
            del self.token_ids[common:]
            self.last_turn_end = min(self.last_turn_end, common)
        self.append(list(token_ids[common:]))
        return common

    def fork(self, length: int) -> Session:
        """A new session of the same engine over the first ``length`` tokens of this trajectory,
        sharing their cache blocks (``method.fork_state``: a reference per block, no copy). Only
        between turns; the two sessions then go on independently.

        Raises:
            SessionBusyError: a turn runs on this session.
            ValueError: ``length`` is not in ``[0, len(self)]``.
        """
        self._check_idle("fork")
        self._resident()
        if not 0 <= length <= len(self.token_ids):
            raise ValueError(f"cannot fork {length} tokens of a {len(self.token_ids)}-token trajectory")
        return Session(
            self.engine,
            token_ids=self.token_ids[:length],
            authors=self.authors[:length],
            state=None if self.dropped else self.method.fork_state(self.state, length),
            last_turn_end=min(self.last_turn_end, length),
            cache_salt=self.cache_salt,
            dropped=self.dropped,  # a fork of dropped caches rebuilds its own
        )

    def close(self) -> None:
        """Give every cache block back to the pool now (published ones stay cached for prefix
        reuse) and empty the trajectory. Only between turns.

        Raises:
            SessionBusyError: a turn runs on this session.
        """
        self._check_idle("close")
        self.engine.scheduler.swap_space.forget(self)  # host copies of swapped-out caches go too
        self.dropped = False
        self.method.truncate(self.state, 0)
        self.token_ids.clear()
        self.authors.clear()
        self.last_turn_end = 0

    def fork_open(self, length: int) -> Session:
        """A fork over the first ``length`` tokens while a turn is open on this session: the fork
        carries the open turn's caches (parallel sampling; only the scheduler calls this)."""
        return Session(
            self.engine,
            token_ids=self.token_ids[:length],
            authors=self.authors[:length],
            state=self.method.fork_state(self.state, length, open_turn=True),
            last_turn_end=self.last_turn_end,
            cache_salt=self.cache_salt,
        )

    def forget_caches(self) -> None:
        """Empty every cache (after the caches were lost: a preempted request that failed); the
        tokens stay, and the next turn prefills them again."""
        self.state = self.method.new_state()
        self.state.salt = self.cache_salt
        self.authors.clear()

    def drop_caches(self) -> None:
        """Give every cache block back and keep only the tokens and their authors (the engine's swap
        space dropped this idle session's caches); the next request rebuilds the caches from them.
        Only between turns."""
        self.method.truncate(self.state, 0)  # blocks of a swapped-out state are released already
        self.state = self.method.new_state()
        self.state.salt = self.cache_salt
        self.dropped = True

    def cache_bytes(self) -> dict:
        """Bytes per cache: ``{"base", "lr": {agent: n}, "full": {agent: n}, "turn", "total", "peak"}``."""
        out = self.method.cache_bytes(self.state)
        out["peak"] = self.peak_bytes
        return out

    def note_cache_bytes(self) -> None:
        """Fold the current cache size into ``peak_bytes`` (called after every forward)."""
        self.peak_bytes = max(self.peak_bytes, self.method.cache_bytes(self.state)["total"])

    def check(self) -> None:
        """Cache integrity check (raises :class:`~precache.errors.CacheIntegrityError`)."""
        self.method.check(self.state)

    # -- turns ---------------------------------------------------------------------------------
    def generate(self, agent: str | None = None, **kwargs: Unpack[SamplingOptions]) -> Turn:
        """Run one turn for ``agent`` (None: base model) and return it. Keyword arguments are
        :class:`~precache.config.SamplingParams` fields (``max_new_tokens``, ``temperature``, ``stop``,
        ``ignore_eos``, ``logprobs``, ``logit_bias`` as ``{token id: bias}``, ...). The text follows
        the OpenAI rule (no stop string, no EOS text: see ``SamplingParams``) and is the
        concatenation of :meth:`stream`'s chunks. Another thread's turn on this session runs first.
        A turn that reaches the context length before ``max_new_tokens`` ends there with
        ``stop_reason="length"`` (as vLLM's offline ``LLM.generate``; the server, like vLLM's, refuses
        such a request up front with a 400).

        Raises:
            UnknownAdapterError, EmptyRequestError, ContextLengthError, ValueError: bad request
            (``n > 1``: use :meth:`generate_choices`); the session is left unchanged.
            CacheCapacityError: the turn could never fit the block pool.
            RequestCancelledError: another thread cancelled the request.
        """
        if kwargs.get("n", 1) != 1:
            raise ValueError("generate returns one turn: use generate_choices for n > 1 choices")
        request = self.submit(agent, **kwargs)
        self.engine.wait(request)
        return request.outcome()

    def generate_choices(
        self, agent: str | None = None, n: int = 2, **kwargs: Unpack[SamplingOptions]
    ) -> list[Turn]:
        """``n`` choices of one turn (parallel sampling, vLLM's ``n``): the prompt is prefilled once,
        then the choices decode in the same steps on forks of its caches; choice ``i > 0`` samples
        with ``seed + i`` when a ``seed`` is given. The trajectory goes on with choice 0 (the forks
        are closed). Other keyword arguments and errors as :meth:`generate`."""
        request = self.submit(agent, n=n, **kwargs)
        self.engine.wait(request)
        try:
            return request.outcomes()
        finally:
            for child in request.children:
                child.session.close()

    def submit(
        self,
        agent: str | None = None,
        params: SamplingParams | None = None,
        **kwargs: Unpack[SamplingOptions],
    ) -> Request:
        """Validate and queue a turn (as :meth:`generate`, ``n`` choices allowed) without waiting for
        it; the engine runs it as it steps (:meth:`Engine.wait`, :meth:`Engine.step`). ``params``
        (built once, e.g. by the server) replaces the keyword arguments."""
        if params is not None and kwargs:
            raise ValueError(f"pass params or sampling keyword arguments, not both (got {sorted(kwargs)})")
        return self.engine.submit(Request(self, agent, self.validate(agent, params or kwargs)))

    def stream(self, agent: str | None = None, **kwargs: Unpack[SamplingOptions]) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, yielding each token as it is sampled with the text it makes safe to
        send (:class:`~precache.engine.outputs.StreamChunk`: never a partial character nor the start
        of a stop string; the chunks' texts concatenate to the turn's text); the turn lands in
        ``last_turn``.

        Validation happens on the call, and the request joins the batch at once; leaving the
        iterator early cancels the turn (its tokens so far stay in the trajectory).
        """
        if kwargs.get("n", 1) != 1:
            raise ValueError("stream yields one turn: use submit(n=...) and each request's chunks")
        return self._chunks(self.submit(agent, **kwargs))

    def teacher_force(self, agent: str | None, token_ids: list[int]) -> Turn:
        """Run ``agent``'s turn producing exactly ``token_ids`` (teacher forcing) and return it, with
        ``turn.logits`` ``[len(token_ids), vocab]``: the fp32 logits each forced token was predicted
        from. The caches end as after a turn that generated those tokens (the last one pending).

        Raises:
            UnknownAdapterError, EmptyRequestError, ContextLengthError: as :meth:`generate`.
        """
        if not token_ids:
            raise EmptyRequestError("teacher forcing needs at least one token")
        params = self.validate(agent, {"max_new_tokens": len(token_ids)})
        check_room(len(self.token_ids), self.engine.max_context, len(token_ids), param="token_ids")
        request = self.engine.submit(Request(self, agent, params, forced=list(token_ids)))
        self.engine.wait(request)
        return request.outcome()

    def validate(self, agent: str | None, kwargs: dict | SamplingParams) -> SamplingParams:
        """Check a turn request against this session (:mod:`precache.engine.validation`, the checks
        the server runs too); return its :class:`SamplingParams` (``kwargs``: its fields as
        :meth:`generate` takes them, or the parameters themselves).

        Raises:
            UnknownAdapterError, EmptyRequestError, ContextLengthError, ValueError: bad request.
        """
        check_adapter(self.engine.adapters, agent)
        params = kwargs if isinstance(kwargs, SamplingParams) else params_from_options(kwargs)
        check_token_ids(params, self.engine.model.config.vocab_size)
        if params.structured_output is not None:
            check_structured_output(self.engine, params.structured_output)
        check_room(len(self.token_ids), self.engine.max_context)
        return params

    # -- what the open turn and the swap space report (they never write these fields) ------------
    def start_turn(self, request: Request) -> None:
        """``request``'s turn is open on this session (until :meth:`commit_turn`)."""
        self.active = request

    def extend_authors(self, agent: str | None, end: int) -> None:
        """Tokens from ``len(authors)`` up to ``end`` were processed first by ``agent`` (None: the
        base model, or blocks another trajectory published)."""
        self.authors.extend([agent] * (end - len(self.authors)))

    def add_token(self, token_id: int) -> None:
        """The open turn generated ``token_id``: it joins the trajectory."""
        self.token_ids.append(token_id)

    def close_turn(self) -> None:
        """The open turn generated its last token: what is appended from now on is the next turn's."""
        self.last_turn_end = len(self.token_ids)

    def commit_turn(self, turn: Turn) -> None:
        """The open turn is over (its post-turn pass too) and ``turn`` is its record: the session is
        free for the next one."""
        self.active, self.last_turn, self.last_used = None, turn, time.perf_counter()

    def release_turn(self, request: Request) -> None:
        """``request`` failed: the session is free, with no record (unless another turn is open)."""
        if self.active is request:
            self.active = None

    def note_swapped(self, copies: SwappedBlocks | None) -> None:
        """The caches now live in host memory as ``copies`` (None: back in the pool, or freed)."""
        self.swapped = copies

    def note_rebuilt(self, exact: bool) -> None:
        """The dropped caches were rebuilt from the tokens; not ``exact``: the method starts the
        trajectory over, so the authors are forgotten and the next turn prefills every token."""
        if not exact:
            self.authors.clear()
        self.dropped = False

    def _chunks(self, request: Request) -> Iterator[StreamChunk]:
        try:
            while True:
                self.engine.wait(request, lambda: bool(request.chunks) or request.finished)
                while request.chunks:
                    yield request.chunks.popleft()
                if request.finished:
                    break
        finally:
            if not request.finished:  # the consumer left: close the turn, keep the caches sound
                self.engine.cancel(request)
                self.engine.wait(request)
        request.outcome()

    def _resident(self) -> None:
        """Swap the caches back in if the engine swapped this idle session out (between two of its
        steps, so no forward sees the pool change).

        Raises:
            OutOfBlocksError: the pool cannot hold them now.
        """
        if self.swapped is not None:
            space = self.engine.scheduler.swap_space
            self.engine.scheduler.exclusive(lambda: space.swap_in(self))

    def _check_idle(self, what: str) -> None:
        if self.active is not None:
            raise SessionBusyError(f"cannot {what} session {self.id}: request {self.active.id} runs on it")
