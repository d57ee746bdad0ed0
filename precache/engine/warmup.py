"""Throwaway trajectories that make the engine's captured decode step compile every layout before
any request (:meth:`precache.engine.engine.Engine.compile_decode_step`).

A layout is what makes dynamo trace a graph of its own (:func:`precache.models.step_graph._variant`):
one row or more; for one row, its keys in one run of the pool, two runs (both read in place) or
more (gathered); whether its view reads LR columns. Between rounds the block after every held block
is held, so a trajectory's next block starts a new run whether or not prefix caching places one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from precache.engine.engine import Engine
    from precache.engine.session import Session


def compile_layouts(engine: Engine) -> None:
    """Decode a few tokens on throwaway trajectories whose keys lie in one run of the pool, then
    two, then three: one of the first adapter alone, one where the first two take turns (a step of
    one reads the other's segments: ReBaseOwnShared's LR columns); then two rows at once. The
    sessions and the held spacer blocks are released after."""
    agents, alloc = list(engine.adapters)[:2] or [None], engine.pool.allocator
    size, vocab = engine.pool.block_size, engine.model.config.vocab_size
    spacers: list[int] = []

    def decode(sessions: list[Session], appended: list[list[int]], agent: str | None) -> None:
        for s, ids in zip(sessions, appended, strict=True):
            s.append(ids)
        engine.wait_all(
            [s.submit(agent, max_new_tokens=3, temperature=0.0, ignore_eos=True) for s in sessions]
        )

    alone, shared = engine.session(), engine.session()
    pair = [engine.session(), engine.session()]
    first, second = agents[0], agents[-1]
    rounds = (
        ((alone, first), (shared, first), (shared, second)),  # keys in one run of the pool
        ((alone, first), (shared, first)),  # two runs, read in place
        ((alone, first), (shared, second)),  # three runs, gathered
    )
    try:
        n = 0
        for i, turns in enumerate(rounds):
            if i:
                spacers.extend(alloc.allocate(after=b) for b in alloc.held_before_free())
            for session, agent in turns:  # each block's ids its own: no prefix is shared
                decode([session], [[1 + (n * size + j) % (vocab - 1) for j in range(size)]], agent)
                n += 1
        decode(pair, [[1, 2, 3], [2, 3, 4]], first)
    finally:  # a failed compile leaves no session or spacer holding blocks
        for s in (alone, shared, *pair):
            s.close()
        for block in spacers:
            alloc.release(block)
