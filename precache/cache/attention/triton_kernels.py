"""The Triton kernel of the ``triton`` attention backend (imported only when that backend runs).

One launch covers every row of a forward: prefill continuations and decode rows alike. Program
``(tile, kv_head, split)`` takes ``BLOCK_M`` query slots of one row (query ``t`` and query head
``g`` of the kv head's GQA group flattened to slot ``t * G + g``, so a decode step still fills the
tile) and walks ``BLOCK_N`` keys at a time through the row's slot table (pool row and position
of every key, the row's block table expanded once per forward). Per key tile it

- loads ``Kb`` and, for keys read with an LR cache, adds ``RoPE(s Lk B^k)`` as
  ``(Lk sB^k) * cos + (Lk rot(sB^k)) * sin`` (RoPE is linear, ``rot`` is rotate-half applied to the
  columns of ``B^k`` beforehand; DESIGN.md, Notation);
- masks keys after each query's position (causal offsets, varlen rows) and, at a layer with a
  sliding window ``w``, keys at or before ``t - w`` (transformers' sliding-window mask), then the online softmax
  (Dao et al., FlashAttention-2, Algorithm 1) accumulates ``P Vb`` ``[BLOCK_M, D]`` and
  ``P Lv`` ``[BLOCK_M, R]`` with the same rescaling;
- at the end adds ``(P Lv) sB^v``: the values ``P Vb + s (P Lv) B^v`` are never materialised.

Ranks and head dims are padded to powers of two >= 16 (``tl.dot``'s minimum) and masked. With
``SPLIT`` the program covers a share of the keys (flash-decoding) and writes its unnormalised
output and ``(max, sum)`` for :func:`combine_splits`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32; ``UPCAST`` multiplies fp32 copies (Triton's interpreter has no
    bf16 matmul: numpy lacks the type)."""
    if UPCAST:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a, b)
    return out


@triton.jit(do_not_specialize=["n_tokens", "rank_off", "window"])
def paged_lora_attention(
    q_ptr,
    out_ptr,
    k_ptr,
    v_ptr,
    lr_ptr,
    key_slot_ptr,
    key_pos_ptr,
    key_lr_ptr,
    rows_ptr,
    rank_k_ptr,
    rank_v_ptr,
    bk_ptr,
    bkrot_ptr,
    bv_ptr,
    cos_ptr,
    sin_ptr,
    tiles_ptr,
    part_o_ptr,
    part_ml_ptr,
    stride_qn,
    stride_qh,
    stride_kp,
    stride_kh,
    stride_lrp,
    stride_cos,
    n_tokens,
    rank_off,
    window,
    qk_scale,
    G: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_K_LR: tl.constexpr,
    HAS_V_LR: tl.constexpr,
    HAS_LR: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    row = tl.load(tiles_ptr + tile * 4)  # tiles [n_tiles, 4]: row, first slot, visible keys, pad
    m0 = tl.load(tiles_ptr + tile * 4 + 1)
    n_keys = tl.load(tiles_ptr + tile * 4 + 2)
    # rows [n_rows, 8]: key offset, first query, queries, q_start, adapter, LR col k, LR col v, pad
    key_off = tl.load(rows_ptr + row * 8).to(tl.int64)
    q_off = tl.load(rows_ptr + row * 8 + 1)
    q_len = tl.load(rows_ptr + row * 8 + 2)
    q_start = tl.load(rows_ptr + row * 8 + 3)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    t = offs_m // G
    qh = hk * G + offs_m % G
    m_valid = t < q_len
    q_pos = q_start + t
    oldest = tl.where(window > 0, q_pos - window, -1)  # sliding window: keys after q_pos - window
    offs_d = tl.arange(0, D_PAD)
    d_valid = offs_d < D
    q_rows = (q_off + t).to(tl.int64) * stride_qn + qh * stride_qh
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_d[None, :], mask=m_valid[:, None] & d_valid[None, :], other=0.0
    )

    offs_r = tl.arange(0, R_PAD)
    adapter = tl.load(rows_ptr + row * 8 + 4)
    b_rows = ((adapter * HKV + hk) * R_PAD + offs_r).to(tl.int64) * D
    b_offs = b_rows[:, None] + offs_d[None, :]  # [R_PAD, D_PAD] of this kv head's slice of B
    if HAS_K_LR:
        rank_k = tl.load(rank_k_ptr + rank_off + row)
        col_k = tl.load(rows_ptr + row * 8 + 5)
        bk = tl.load(bk_ptr + b_offs, mask=d_valid[None, :], other=0.0).to(lr_ptr.dtype.element_ty)
        bkrot = tl.load(bkrot_ptr + b_offs, mask=d_valid[None, :], other=0.0).to(lr_ptr.dtype.element_ty)
    if HAS_V_LR:
        rank_v = tl.load(rank_v_ptr + rank_off + row)
        col_v = tl.load(rows_ptr + row * 8 + 6)
        acc_lr = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)

    chunk = tl.cdiv(tl.cdiv(n_keys, n_splits), BLOCK_N) * BLOCK_N
    k_lo = split * chunk
    k_hi = tl.minimum(n_keys, k_lo + chunk)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for n0 in range(k_lo, k_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < k_hi
        slot = tl.load(key_slot_ptr + key_off + offs_n, mask=n_valid, other=0).to(tl.int64)
        k_pos = tl.load(key_pos_ptr + key_off + offs_n, mask=n_valid, other=0)
        kd_mask = n_valid[:, None] & d_valid[None, :]
        kv_offs = slot[:, None] * stride_kp + hk * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kd_mask, other=0.0)
        if HAS_LR:  # HAS_K_LR or HAS_V_LR, decided on the host
            has_lr = tl.load(key_lr_ptr + key_off + offs_n, mask=n_valid, other=0) != 0
        if HAS_K_LR:
            lk_mask = has_lr[:, None] & (offs_r < rank_k)[None, :]
            lk = tl.load(
                lr_ptr + slot[:, None] * stride_lrp + col_k + offs_r[None, :], mask=lk_mask, other=0.0
            )
            rope_offs = k_pos.to(tl.int64)[:, None] * stride_cos + offs_d[None, :]
            cos = tl.load(cos_ptr + rope_offs, mask=kd_mask, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + rope_offs, mask=kd_mask, other=0.0).to(tl.float32)
            delta = _mma(lk, bk, UPCAST) * cos + _mma(lk, bkrot, UPCAST) * sin
            k = (k.to(tl.float32) + delta).to(k.dtype)
        s = _mma(q, tl.trans(k), UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = n_valid[None, :] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > oldest[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_offs, mask=kd_mask, other=0.0)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, UPCAST)
        if HAS_V_LR:
            lv_mask = has_lr[:, None] & (offs_r < rank_v)[None, :]
            lv = tl.load(
                lr_ptr + slot[:, None] * stride_lrp + col_v + offs_r[None, :], mask=lv_mask, other=0.0
            )
            acc_lr = acc_lr * alpha[:, None] + _mma(p.to(lv.dtype), lv, UPCAST)
        m_i = m_new
    if HAS_V_LR:
        bv = tl.load(bv_ptr + b_offs, mask=d_valid[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(acc_lr, bv)

    out_mask = m_valid[:, None] & d_valid[None, :]
    if SPLIT:
        part = ((split * n_tokens + q_off + t).to(tl.int64) * (HKV * G) + qh) * D
        tl.store(part_o_ptr + part[:, None] + offs_d[None, :], acc, mask=out_mask)
        ml = ((split * n_tokens + q_off + t).to(tl.int64) * (HKV * G) + qh) * 2
        tl.store(part_ml_ptr + ml, m_i, mask=m_valid)
        tl.store(part_ml_ptr + ml + 1, l_i, mask=m_valid)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + q_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


def combine_splits(part_o: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor) -> None:
    """Merge flash-decoding splits into ``out`` ``[N, Hq, D]``: ``sum_s 2^(m_s - M) o_s / sum_s
    2^(m_s - M) l_s`` with ``M = max_s m_s`` (``part_o`` ``[S, N, Hq, D]`` unnormalised outputs,
    ``part_ml`` ``[S, N, Hq, 2]`` running max in log2 units and softmax sum)."""
    m, sums = part_ml[..., 0], part_ml[..., 1]  # [S, N, Hq]
    top = m.max(0).values
    w = torch.exp2(m - torch.where(torch.isinf(top), 0.0, top))  # a split with no key: m = -inf, w = 0
    num = (w.unsqueeze(-1) * part_o).sum(0)
    den = (w * sums).sum(0).clamp_min(torch.finfo(torch.float32).tiny)
    out.copy_(num / den.unsqueeze(-1))
