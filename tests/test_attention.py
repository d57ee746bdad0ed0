"""The segment attention kernel against plain materialised attention, over both code paths
(explicit softmax for decode-sized rows, packed SDPA otherwise)."""

from __future__ import annotations

import math

import pytest
import torch

from precache.cache.attention import Segment, attend


def _reference(q, q_start, segments, window=None):
    """Materialise V = Vb + s Lv B per segment and run a plain masked softmax (key p visible to
    query t when p <= t and, with a sliding window, p > t - window)."""
    keys = torch.cat([s.k for s in segments])
    values = []
    for s in segments:
        v = s.v.clone()
        if s.lv is not None:
            v += s.scaling * (s.lv @ s.bv).view(v.shape)
        values.append(v)
    values = torch.cat(values)
    pos = torch.cat([torch.arange(s.start, s.start + s.k.shape[0]) for s in segments])
    T, Hq, D = q.shape
    G = Hq // keys.shape[1]
    k, v = keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1)
    scores = torch.einsum("thd,nhd->htn", q, k) / math.sqrt(D)
    q_pos = (q_start + torch.arange(T))[:, None]
    mask = pos[None, :] <= q_pos
    if window is not None:
        mask &= pos[None, :] > q_pos - window
    return torch.einsum("htn,nhd->thd", torch.softmax(scores.masked_fill(~mask, -torch.inf), -1), v).reshape(
        T, -1
    )


@pytest.mark.parametrize("T", [1, 3, 9])
@pytest.mark.parametrize("layout", ["plain", "lr", "two-segments", "two-segments-lr", "two-lr-terms"])
def test_attend_matches_materialised_reference(T, layout):
    g = torch.Generator().manual_seed(T)
    Hq, Hkv, D, r, n1, n2 = 6, 2, 8, 3, 11, 5

    def seg(start, n, with_lr, rank=r):
        k, v = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)
        if not with_lr:
            return Segment(k, v, start)
        return Segment(
            k, v, start, torch.randn(n, rank, generator=g), torch.randn(rank, Hkv * D, generator=g), 0.7
        )

    segments = {
        "plain": [seg(0, n1 + n2, False)],
        "lr": [seg(0, n1 + n2, True)],
        "two-segments": [seg(0, n1, False), seg(n1, n2, False)],
        "two-segments-lr": [seg(0, n1, True), seg(n1, n2, False)],
        "two-lr-terms": [seg(0, n1, True), seg(n1, n2, True, rank=5)],
    }[layout]
    q_start = n1 + n2 - T  # the row's own tokens are the last T keys
    q = torch.randn(T, Hq, D, generator=g)
    got = attend(q, q_start, segments)
    assert got.shape == (T, Hq * D)
    assert torch.allclose(got, _reference(q, q_start, segments), atol=1e-5)


@pytest.mark.parametrize("with_lr", [False, True])
def test_first_prefill_uses_the_same_causal_maths(with_lr):
    """A row that is the whole sequence takes SDPA's is_causal path: same values as the reference."""
    g = torch.Generator().manual_seed(5)
    T, Hq, Hkv, D, r = 12, 6, 2, 8, 3
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    seg = Segment(k, v, 0)
    if with_lr:
        seg = Segment(k, v, 0, torch.randn(T, r, generator=g), torch.randn(r, Hkv * D, generator=g), 0.5)
    q = torch.randn(T, Hq, D, generator=g)
    assert torch.allclose(attend(q, 0, [seg]), _reference(q, 0, [seg]), atol=1e-5)


@pytest.mark.parametrize("n_cached", [1, 300])
def test_long_continuation_prefill_in_query_chunks_matches_the_reference(n_cached):
    """A continuation row of >= 2 * CHUNK_MIN queries runs in query chunks: same values."""
    from precache.cache.attention.segments import CHUNK_MIN

    g = torch.Generator().manual_seed(n_cached)
    T, Hq, Hkv, D, r = 2 * CHUNK_MIN + 9, 6, 2, 8, 3
    n = n_cached + T
    k, v = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)
    cached = Segment(
        k[:n_cached],
        v[:n_cached],
        0,
        torch.randn(n_cached, r, generator=g),
        torch.randn(r, Hkv * D, generator=g),
        0.5,
    )
    segments = [cached, Segment(k[n_cached:], v[n_cached:], n_cached)]
    q = torch.randn(T, Hq, D, generator=g)
    assert torch.allclose(attend(q, n_cached, segments), _reference(q, n_cached, segments), atol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 7, 40])
@pytest.mark.parametrize("T", [1, 3, 9])
@pytest.mark.parametrize("layout", ["plain", "lr", "two-segments-lr", "first-prefill"])
def test_sliding_window_matches_the_masked_reference(window, T, layout):
    """Keys ``p <= t - window`` are hidden, on the decode path, the fused path and a first prefill."""
    g = torch.Generator().manual_seed(window * 10 + T)
    Hq, Hkv, D, r = 6, 2, 8, 3
    n = T if layout == "first-prefill" else 16

    def seg(start, m, with_lr):
        k, v = torch.randn(m, Hkv, D, generator=g), torch.randn(m, Hkv, D, generator=g)
        if not with_lr:
            return Segment(k, v, start)
        return Segment(k, v, start, torch.randn(m, r, generator=g), torch.randn(r, Hkv * D, generator=g), 0.7)

    if layout == "two-segments-lr":
        segments = [seg(0, 10, True), seg(10, n - 10, False)]
    else:
        segments = [seg(0, n, layout == "lr")]
    q = torch.randn(T, Hq, D, generator=g)
    q_start = n - T
    got = attend(q, q_start, segments, window)
    assert torch.allclose(got, _reference(q, q_start, segments, window), atol=1e-5)
    if window < n - 1:  # the window hides keys: the plain causal result differs
        assert not torch.allclose(got, _reference(q, q_start, segments), atol=1e-3)


def test_long_continuation_prefill_in_query_chunks_with_a_window():
    """The query-chunked continuation path applies the window too."""
    from precache.cache.attention.segments import CHUNK_MIN

    g = torch.Generator().manual_seed(3)
    T, n_cached, Hq, Hkv, D, window = 2 * CHUNK_MIN + 9, 40, 6, 2, 8, 50
    n = n_cached + T
    k, v = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)
    segments = [Segment(k[:n_cached], v[:n_cached], 0), Segment(k[n_cached:], v[n_cached:], n_cached)]
    q = torch.randn(T, Hq, D, generator=g)
    got = attend(q, n_cached, segments, window)
    assert torch.allclose(got, _reference(q, n_cached, segments, window), atol=1e-5)
