"""The ``triton`` attention backend: one fused kernel per layer over every row of the batch.

The kernel (:mod:`precache.cache.attention.triton_kernels`) reads the pool in place through a slot
table per row and computes ``softmax(q K^T / sqrt(D)) (Vb + s Lv B^v)`` with
``K = Kb + RoPE(s Lk B^k)`` (DESIGN.md, Notation) without materialising ``K`` or ``V``: prefill
continuations, decode rows, GQA and ReBaseShared DB's adapter-free rows all go in one launch.
Everything the kernel needs that does not change between layers (slot tables, tiles, ranks, the
adapters' stacked ``B``) is built once per forward by :meth:`TritonBackend.prepare`
(:mod:`precache.cache.attention.triton_metadata`) and kept on the forward's ``BatchMetadata``.

Sliding windows (``RowAttention.window``) are masked in the kernel, per layer. What it refuses,
falling back to the torch reference for the whole forward (logged once at INFO): a row whose reads
carry two different adapters or LR column sets, reads from several pools, rows with different
sliding windows, a model dtype (that of the queries) that differs from the pool's, and, on CUDA,
a k-side LR term on tiles of more than 16 query slots (prefill with a k_proj LoRA), which faulted
on an H200 (:data:`~precache.cache.attention.triton_metadata.K_LR_MAX_CUDA_SLOTS`).

Chosen by default when the model is on CUDA and triton is installed (:func:`default_backend`).
"""

from __future__ import annotations

import logging
import math

import torch

from precache.cache.attention.base import AttentionBackend, BatchMetadata, register_backend
from precache.cache.attention.torch_backend import TorchBackend
from precache.cache.attention.triton_metadata import (
    Refusal,
    TritonMetadata,
    build,
    pow2_at_least_16,
    refusal,
)

logger = logging.getLogger(__name__)


def triton_available() -> bool:
    """True when ``import triton`` works."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend(device) -> str:
    """``"triton"`` on CUDA when triton is installed, else ``"torch"``."""
    on_cuda = torch.device(device or "cpu").type == "cuda"
    return "triton" if on_cuda and triton_available() else "torch"


@register_backend
class TritonBackend(AttentionBackend):
    """Paged attention with the LR terms fused, in one Triton kernel per layer.

    ``num_splits`` fixes the number of key splits per program (flash-decoding); None picks one
    from the device's multiprocessor count (1 on CPU, where the kernel runs in Triton's
    interpreter, ``TRITON_INTERPRET=1``). ``block_n`` is the key tile (tokens). ``refused``: the
    reasons for which some forward ran the torch reference instead (empty when none did).

    Raises:
        ImportError: triton is not installed (``pip install 'precache[triton]'``).
    """

    name = "triton"

    def __init__(self, num_splits: int | None = None, block_n: int = 64):
        if not triton_available():
            raise ImportError("the 'triton' attention backend needs triton: pip install 'precache[triton]'")
        from precache.cache.attention import triton_kernels

        self._kernels = triton_kernels
        self.num_splits, self.block_n = num_splits, block_n
        self._torch = TorchBackend()
        self.refused: set[str] = set()

    def prepare(self, meta: BatchMetadata, model) -> None:
        """The kernel's inputs for every layer of this forward
        (:class:`~precache.cache.attention.triton_metadata.TritonMetadata`) on ``meta.prepared``,
        or a :class:`~precache.cache.attention.triton_metadata.Refusal` (logged once per reason)
        when the kernel cannot run it."""
        if not meta.rows:  # every token narrowed away: nothing to attend
            meta.prepared = Refusal("no rows")
            return
        reason = refusal(meta, model)
        if reason is None:
            meta.prepared = build(meta, model, self.block_n, self.num_splits)
            return
        if reason not in self.refused:
            self.refused.add(reason)
            logger.info("triton attention backend: %s; this forward runs the torch reference", reason)
        meta.prepared = Refusal(reason)

    @staticmethod
    def _compile_options(q: torch.Tensor, block_m: int) -> dict:
        """Warps and pipeline stages on a GPU (FlashAttention-2's Triton settings for these tiles);
        none for the interpreter."""
        if not q.is_cuda:
            return {}
        return {"num_warps": 8 if block_m == 128 else 4, "num_stages": 3 if block_m >= 64 else 2}

    def forward(self, q: torch.Tensor, layer: int, meta: BatchMetadata, model) -> torch.Tensor:
        """Attention of every row at ``layer``: ``q`` ``[N, n_heads, head_dim]`` -> ``[N, n_heads * head_dim]``.

        Raises:
            ValueError: ``meta`` was not prepared by a triton backend (:meth:`prepare`).
        """
        prepared = meta.prepared
        if isinstance(prepared, Refusal):
            return self._torch.forward(q, layer, meta, model)
        if not isinstance(prepared, TritonMetadata):
            raise ValueError("call TritonBackend.prepare(meta, model) once per forward, before its layers")
        return self._launch(q, layer, prepared, model)

    def _launch(self, q: torch.Tensor, layer: int, p: TritonMetadata, model) -> torch.Tensor:
        c = model.config
        q = q if q.stride(-1) == 1 else q.contiguous()
        n, hq, d = q.shape
        pool = p.pool
        k, v, lr = pool.k[layer], pool.v[layer], pool.lr[layer]
        out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
        if p.n_splits > 1:
            part_o = torch.empty(p.n_splits, n, hq, d, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(p.n_splits, n, hq, 2, dtype=torch.float32, device=q.device)
        else:
            part_o = part_ml = out
        bk, bkrot, bv = (x[layer] for x in p.b) if p.b is not None else (out, out, out)
        cos, sin = model.rope.cos, model.rope.sin
        grid = (p.tiles.shape[0], c.num_kv_heads, p.n_splits)
        self._kernels.paged_lora_attention[grid](
            q,
            out,
            k,
            v,
            lr,
            p.key_slot,
            p.key_pos,
            p.key_lr,
            p.rows,
            p.rank_k,
            p.rank_v,
            bk,
            bkrot,
            bv,
            cos,
            sin,
            p.tiles,
            part_o,
            part_ml,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            lr.stride(0),
            cos.stride(0),
            n,
            layer * p.rank_k.shape[1],  # rank tables are [n_layers, n_rows]: no per-layer views
            p.windows[layer] or 0,
            math.log2(math.e) / math.sqrt(d),
            G=hq // c.num_kv_heads,
            HKV=c.num_kv_heads,
            D=d,
            D_PAD=pow2_at_least_16(d),
            R_PAD=p.r_pad,
            BLOCK_M=p.block_m,
            BLOCK_N=self.block_n,
            HAS_K_LR=p.has_k,
            HAS_V_LR=p.has_v,
            HAS_LR=p.has_k or p.has_v,
            SPLIT=p.n_splits > 1,
            UPCAST=q.device.type == "cpu",  # only the interpreter runs on CPU tensors
            **self._compile_options(q, p.block_m),
        )
        if p.n_splits > 1:
            self._kernels.combine_splits(part_o, part_ml, out)
        return out.view(n, hq * d)
