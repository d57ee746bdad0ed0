"""The attention maths of one row's queries over cache segments (the torch reference).

A segment is a contiguous span of key positions with keys ``K`` ``[n, n_kv_heads, head_dim]``
(already the agent's view: base keys plus, for adapters with a k_proj LoRA, the RoPE'd LoRA part),
base values ``Vb`` and optionally an LR value term ``(Lv [n, r], B^v [r, n_kv_heads * head_dim], s)``.
The output is ``P Vb + s (P Lv) B^v`` (DESIGN.md, Notation): decode rows never build full adapted
values (the reordering LRAgent's Flash-LoRA-Attention exploits); prefill rows build them for one
layer at a time, which is cheaper than widening the attention by ``r`` channels.

A sliding window ``w`` (Mistral, Qwen2/Qwen3 sliding layers) hides key ``p`` from query ``t``
when ``p <= t - w``, as transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - w``): keys that
no query of the row can see are cut off before the scores are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: rows of up to this many queries use the explicit softmax when they read an LR term or several segments
DECODE_MAX = 4
#: continuation prefills of at least ``2 * CHUNK_MIN`` queries run in ``CHUNKS`` query chunks
CHUNK_MIN, CHUNKS = 256, 4


@dataclass
class Segment:
    """Keys/values at trajectory positions ``[start, start + n)``; ``lv``/``bv``: the LR value term."""

    k: torch.Tensor
    v: torch.Tensor
    start: int
    lv: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    scaling: float = 1.0


def _causal_mask(
    q_start: int, n_queries: int, segments: list[Segment], device, window: int | None = None
) -> torch.Tensor:
    """``[T, n_keys]`` bool, True where key position <= query position (and, with a sliding
    ``window``, key position > query position - window)."""
    key_pos = torch.cat([torch.arange(s.start, s.start + s.k.shape[0], device=device) for s in segments])
    q_pos = torch.arange(q_start, q_start + n_queries, device=device)
    mask = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > q_pos[:, None] - window
    return mask


def _windowed(q_start: int, n_queries: int, segments: list[Segment], window: int | None) -> bool:
    """Whether the window hides some key of ``segments`` from the row's last query."""
    return window is not None and segments[0].start <= q_start + n_queries - 1 - window


def _trim(segments: list[Segment], first_visible: int) -> list[Segment]:
    """``segments`` without the key positions below ``first_visible`` (outside every query's window)."""
    out = []
    for s in segments:
        cut = first_visible - s.start
        n = s.k.shape[0]
        if cut >= n:
            continue
        if cut > 0:
            lv = None if s.lv is None else s.lv[cut:]
            s = Segment(s.k[cut:], s.v[cut:], first_visible, lv, s.bv, s.scaling)
        out.append(s)
    return out


def _sdpa(q: torch.Tensor, q_start: int, segments: list[Segment], window: int | None = None) -> torch.Tensor:
    """One fused SDPA pass over all segments, each LR value term materialised for this layer only.

    ``V = Vb + s Lv B^v`` costs ``n r (n_kv_heads head_dim)`` multiply-adds, far below the
    attention's ``T n n_heads head_dim``; the stored caches stay base + LR. (Packing ``Lv`` as extra
    value channels instead would widen every q.k product by ``r`` channels.)
    """
    T, Hq, D = q.shape
    values = [s.v if s.lv is None else s.v + s.scaling * (s.lv @ s.bv).view(s.v.shape) for s in segments]
    k = segments[0].k if len(segments) == 1 else torch.cat([s.k for s in segments])  # [n, Hkv, D]
    v = values[0] if len(values) == 1 else torch.cat(values)
    n = k.shape[0]
    key_end = segments[-1].start + segments[-1].k.shape[0]
    # a row that is the whole sequence (a first prefill) is plain causal: the kernel skips the
    # upper triangle, about 1.5x faster than an explicit mask
    windowed = _windowed(q_start, T, segments, window)
    square = T > 1 and q_start == 0 and segments[0].start == 0 and n == T and not windowed
    needs_mask = windowed or (not square and not (T == 1 and key_end <= q_start + 1))
    qh, kh, vh = (
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
    )
    contiguous = key_end - segments[0].start == n and key_end == q_start + T
    if needs_mask and contiguous and T >= 2 * CHUNK_MIN:
        return _chunked(qh, kh, vh, q_start, segments[0].start, window)
    out = F.scaled_dot_product_attention(
        qh,
        kh,
        vh,
        attn_mask=_causal_mask(q_start, T, segments, q.device, window) if needs_mask else None,
        is_causal=square,
        enable_gqa=True,
        scale=1.0 / math.sqrt(D),
    )[0]  # [Hq, T, D]
    return out.transpose(0, 1).reshape(T, Hq * D)


def _chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int, window: int | None = None
) -> torch.Tensor:
    """A continuation prefill (``q`` ``[1, Hq, T, D]`` at positions ``[q_start, q_start + T)`` over
    keys ``[1, Hkv, n, D]`` at ``[k_start, q_start + T)``) in query chunks, each reading only the keys
    up to its own last position (and, with a sliding ``window``, from its first query's window on):
    about ``T n0 + 0.6 T^2`` score entries instead of the masked rectangle's ``T n0 + T^2`` (``n0``
    cached keys), with one plain SDPA call per chunk."""
    T, D = q.shape[2], q.shape[3]
    size = max(CHUNK_MIN, -(-T // CHUNKS))
    out = torch.empty(T, q.shape[1] * D, dtype=q.dtype, device=q.device)
    for a in range(0, T, size):
        b = min(T, a + size)
        keys = q_start + b - k_start  # keys up to the chunk's last query position
        first = 0 if window is None else max(0, q_start + a - window + 1 - k_start)
        key_pos = torch.arange(first, keys, device=q.device)  # relative to k_start
        q_pos = q_start - k_start + torch.arange(a, b, device=q.device)
        mask = key_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= key_pos[None, :] > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(
            q[:, :, a:b],
            k[:, :, first:keys],
            v[:, :, first:keys],
            attn_mask=mask,
            enable_gqa=True,
            scale=1.0 / math.sqrt(D),
        )[0]  # [Hq, b - a, D]
        out[a:b] = o.transpose(0, 1).reshape(b - a, -1)
    return out


def _explicit(
    q: torch.Tensor, q_start: int, segments: list[Segment], window: int | None = None
) -> torch.Tensor:
    """A decode row's attention with its reads in place: scores per segment (the scale folded into
    the few queries), one softmax, then ``P Vb`` and the low-rank value term ``s (P Lv) B^v`` added
    in one batched product per segment."""
    T, Hq, D = q.shape
    Hkv = segments[0].k.shape[1]
    G = Hq // Hkv
    qh = (q * (1.0 / math.sqrt(D))).view(T, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * T, D)
    if len(segments) == 1:
        scores = torch.bmm(qh, segments[0].k.permute(1, 2, 0))  # [Hkv, G*T, n]
    else:
        scores = torch.cat([torch.bmm(qh, s.k.permute(1, 2, 0)) for s in segments], dim=-1)
    key_end = segments[-1].start + segments[-1].k.shape[0]
    if T > 1 or key_end > q_start + 1 or _windowed(q_start, T, segments, window):
        mask = _causal_mask(q_start, T, segments, q.device, window)  # [T, n]
        scores = scores.view(Hkv, G, T, -1).masked_fill(~mask, float("-inf")).view(Hkv, G * T, -1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out, col = None, 0
    for s in segments:
        n = s.k.shape[0]
        p = probs if len(segments) == 1 else probs[..., col : col + n]  # [Hkv, G*T, n_s]
        col += n
        pv = torch.bmm(p, s.v.transpose(0, 1))  # P Vb
        out = pv if out is None else out.add_(pv)
        if s.lv is not None:
            plr = (p.reshape(Hkv * G * T, n) @ s.lv).view(Hkv, G * T, -1)  # P Lv, Lv shared by all heads
            out = torch.baddbmm(out, plr, s.bv.view(-1, Hkv, D).transpose(0, 1), alpha=s.scaling)
    return out.view(Hkv, G, T, D).permute(2, 0, 1, 3).reshape(T, Hq * D)


def attend(q: torch.Tensor, q_start: int, segments: list[Segment], window: int | None = None) -> torch.Tensor:
    """Causal attention of queries ``q`` ``[T, n_heads, head_dim]`` at positions ``[q_start, q_start + T)``,
    over the last ``window`` positions only when a sliding window is given (key ``p`` visible to
    query ``t`` when ``t - window < p <= t``; HF ``sliding_window_overlay``).

    GQA: query head ``h`` reads kv head ``h // (n_heads / n_kv_heads)`` (HF ``repeat_kv`` order).
    Returns ``[T, n_heads * head_dim]``. Decode steps (``T <= DECODE_MAX``) with several segments
    or an LR term run an explicit softmax that reads the segments in place and keeps the value term
    low-rank (``s (P Lv) B^v``); everything else runs one fused SDPA pass (:func:`_sdpa`), which on
    long prefills is several times faster.
    """
    if window is not None:
        segments = _trim(segments, q_start - window + 1)  # keys before the first query's window
    if q.shape[0] <= DECODE_MAX and (len(segments) > 1 or segments[0].lv is not None):
        return _explicit(q, q_start, segments, window)
    return _sdpa(q, q_start, segments, window)
