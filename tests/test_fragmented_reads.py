"""Decode rows over a trajectory whose blocks lie scattered in the pool (a pool whose free blocks
alternate with held ones, as after sessions decoding side by side or a swap-in): reading each contiguous piece in place and gathering the pieces into one
read are the same attention, so both give the tokens and logits of the trajectory run alone."""

from __future__ import annotations

import pytest
import torch

from precache.cache import views
from precache.methods import METHODS
from tests.tiny import make_engine

AGENTS = ("plan", "action", "reflect")


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _side_by_side(tiny, method: str, prompts: list[list[int]]):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, method, prefix_caching=False, block_size=4)
    alloc = engine.pool.allocator
    held = [alloc.allocate() for _ in range(alloc.num_available)]
    for block in sorted(held)[::2]:  # every other block free: no trajectory gets two neighbouring blocks
        alloc.release(block)
    requests = []
    for i, p in enumerate(prompts):
        s = engine.session()
        s.append(p)
        requests.append(
            s.submit(AGENTS[i % 3], max_new_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
        )
    engine.wait_all(requests)
    return requests


@pytest.mark.parametrize("method", METHODS)
def test_scattered_blocks_read_in_place_or_gathered_give_the_alone_turn(tiny, method, monkeypatch):
    model, dirs, _ = tiny
    prompts = [_ids(seed, 9 + 5 * seed) for seed in range(3)]
    alone = []
    for i, p in enumerate(prompts):
        s = make_engine(model, dirs, method, prefix_caching=False, block_size=4).session()
        s.append(p)
        alone.append(
            s.generate(AGENTS[i % 3], max_new_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
        )
    turns = {}
    for limit in (0, 10**6):  # 0: every scattered view is gathered; 10**6: read piece by piece
        monkeypatch.setattr(views, "MAX_INPLACE_PIECES", limit)
        requests = _side_by_side(tiny, method, prompts)
        stores = requests[0].session.state.paged_stores()
        assert max(len(st.runs(st.offset, st.length)) for st in stores) > 4  # scattered
        turns[limit] = [r.outcome() for r in requests]
    for want, gathered, in_place in zip(alone, turns[0], turns[10**6], strict=True):
        assert gathered.token_ids == in_place.token_ids == want.token_ids
        # each decode step's log-probability of its token: the attention over the scattered blocks
        expected = torch.tensor([lp.logprob for lp in want.logprobs])
        for turn in (gathered, in_place):
            got = torch.tensor([lp.logprob for lp in turn.logprobs])
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
