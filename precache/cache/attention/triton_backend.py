"""The ``triton`` attention backend: one fused kernel per layer over every row of the batch.

The kernel (:mod:`precache.cache.attention.triton_kernels`) reads the pool in place through a slot
table per row and computes ``softmax(q K^T / sqrt(D)) (Vb + s Lv B^v)`` with
``K = Kb + RoPE(s Lk B^k)`` (DESIGN.md, Notation) without materialising ``K`` or ``V``: prefill
continuations, decode rows, GQA and ReBaseShared DB's adapter-free rows all go in one launch.
Everything the kernel needs that does not change between layers (slot tables, tiles, ranks, the
adapters' stacked ``B``) is built once per forward, on the host, then copied to the device once.

Sliding windows (``RowAttention.window``) are masked in the kernel, per layer. What it refuses,
falling back to the torch reference for the whole forward (logged once at INFO): a row whose reads
carry two different adapters or LR column sets, reads from several pools, rows with different
sliding windows, and a query dtype that differs from the pool's.

Chosen by default when the model is on CUDA and triton is installed (:func:`default_backend`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from precache.cache.attention.base import AttentionBackend, BatchMetadata, register_backend
from precache.cache.attention.torch_backend import TorchBackend

logger = logging.getLogger(__name__)

_PREPARED_ADAPTER_STACKS = 8  # adapter sets whose stacked B are kept (one per distinct batch mix)


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


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


def _ranges(starts: list[int], lens: list[int]) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lens)])`` in a few vectorised ops (a decode
    batch reads thousands of block runs)."""
    lens_t = torch.tensor(lens, dtype=torch.int64)
    first = torch.cumsum(lens_t, 0) - lens_t  # where each range begins in the output
    shift = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64) - first, lens_t)
    return torch.arange(int(lens_t.sum())) + shift


def _row_ranks(adapters: list, row_adapter: list[int], meta: BatchMetadata, num_layers: int):
    """``(rank_k, rank_v)`` ``[num_layers, n_rows]``: the LR columns a row's adapter adds at each
    layer (0 for a row without LR reads, or a layer where the adapter has no LoRA on k / v)."""
    table = torch.zeros(2, num_layers, len(adapters) + 1, dtype=torch.int64)  # last column: no adapter
    for j, adapter in enumerate(adapters):
        read = next(r for row in meta.rows for r in row.reads if r.adapter is adapter and r.lr_cols)
        widths = [cols.stop - cols.start for cols in read.lr_cols]
        for layer in range(num_layers):
            for side, proj in enumerate(("k_proj", "v_proj")):
                table[side, layer, j] = widths[side] if adapter.has(layer, proj) else 0
    index = torch.tensor(row_adapter, dtype=torch.int64)  # -1 picks the last column
    return table[0][:, index], table[1][:, index]


@dataclass
class _Prepared:
    """One forward's kernel inputs (device tensors), valid for every layer."""

    pool: object
    key_slot: torch.Tensor  # [n_keys] int32 pool rows, row after row
    key_pos: torch.Tensor  # [n_keys] int32 trajectory positions
    key_lr: torch.Tensor  # [n_keys] int8: 1 where the read adds the row adapter's LR part
    rows: (
        torch.Tensor
    )  # [n_rows, 8] int32: key offset, first query, queries, q_start, adapter, col k, col v, 0
    rank_k: torch.Tensor  # [n_layers, n_rows] int32 (0: no k_proj LoRA at that layer)
    rank_v: torch.Tensor  # [n_layers, n_rows] int32
    tiles: torch.Tensor  # [n_tiles, 4] int32: row, first query slot, keys visible to the tile, 0
    b: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # sB^k, rot(sB^k), sB^v [L, n_ad, Hkv, R, D]
    r_pad: int
    block_m: int
    n_splits: int
    windows: tuple[int | None, ...]  # sliding window per layer in tokens (None: full causal)
    has_k: bool
    has_v: bool


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
        self._meta: BatchMetadata | None = None
        self._prepared: _Prepared | None = None
        self._stacks: dict[tuple, tuple] = {}
        self.refused: set[str] = set()

    # -- per forward -----------------------------------------------------------------------------
    def _refusal(self, q: torch.Tensor, meta: BatchMetadata) -> str | None:
        """Why the kernel cannot run this forward (None: it can). One pass over the reads."""
        pool = meta.rows[0].reads[0].pool
        if pool.k.dtype != q.dtype:
            return f"queries are {q.dtype} but the pool holds {pool.k.dtype}"
        window = getattr(meta.rows[0], "window", None)
        for row in meta.rows:
            if getattr(row, "window", None) != window:
                return "rows have different sliding windows"
            first = None
            for read in row.reads:
                if read.pool is not pool:
                    return "the rows read several pools"
                if read.lr_cols is None:
                    continue
                if first is None:
                    first = read
                elif read.adapter is not first.adapter or read.lr_cols != first.lr_cols:
                    return "a row reads the LR caches of two adapters"
        return None

    def _adapter_stack(self, adapters: list, model, r_pad: int) -> tuple[torch.Tensor, ...]:
        """``(sB^k, rot(sB^k), sB^v)`` ``[n_layers, n_adapters, Hkv, r_pad, D]`` (zeros where a layer
        has no LoRA on the projection), ``rot`` = RoPE's rotate-half on each head's columns."""
        key = (tuple(id(a) for a in adapters), r_pad)
        if key in self._stacks:
            return self._stacks[key][1]
        c = model.config
        hkv, d = c.num_kv_heads, c.head_dim
        shape = (c.num_layers, len(adapters), hkv, r_pad, d)
        bk, bv = (torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(2))
        for i, adapter in enumerate(adapters):
            for layer in range(c.num_layers):
                for proj, dst in (("k_proj", bk), ("v_proj", bv)):
                    if adapter.has(layer, proj):
                        b = adapter.weights[(layer, proj)][1] * adapter.scaling  # [r, Hkv * D]
                        dst[layer, i, :, : b.shape[0]] = b.view(b.shape[0], hkv, d).transpose(0, 1)
        half = d // 2
        bkrot = torch.cat((-bk[..., half:], bk[..., :half]), dim=-1)
        if len(self._stacks) >= _PREPARED_ADAPTER_STACKS:
            self._stacks.pop(next(iter(self._stacks)))
        self._stacks[key] = (adapters, (bk.contiguous(), bkrot.contiguous(), bv.contiguous()))
        return self._stacks[key][1]

    def _prepare(self, q: torch.Tensor, meta: BatchMetadata, model) -> _Prepared:
        c, device = model.config, q.device
        group = c.num_heads // c.num_kv_heads
        max_slots = max((row.q_rows.stop - row.q_rows.start) * group for row in meta.rows)
        block_m = 16 if max_slots <= 16 else 128 if q.is_cuda and max_slots >= 1024 else 64
        adapters: list = []
        starts, lens, pos_starts, flags, gathered, rows, tiles, row_adapter = [], [], [], [], [], [], [], []
        key_off = 0
        for i, row in enumerate(meta.rows):
            ad_index = col_k = col_v = -1
            row_keys = 0  # keys of this row's earlier reads
            for read in row.reads:
                if isinstance(read.rows, slice):
                    starts.append(read.rows.start)
                else:  # scattered pool rows, already on the device: copied in place below
                    starts.append(0)
                    gathered.append((key_off + row_keys, read.rows))
                lens.append(read.end - read.start)
                row_keys += lens[-1]
                pos_starts.append(read.start)
                flags.append(int(read.lr_cols is not None and read.adapter is not None))
                if flags[-1]:
                    if not any(a is read.adapter for a in adapters):
                        adapters.append(read.adapter)
                    ad_index = next(j for j, a in enumerate(adapters) if a is read.adapter)
                    col_k, col_v = read.lr_cols[0].start, read.lr_cols[1].start
            n_q, n_keys = row.q_rows.stop - row.q_rows.start, row_keys
            rows.append(
                (
                    key_off,
                    row.q_rows.start,
                    n_q,
                    row.q_start,
                    max(ad_index, 0),
                    max(col_k, 0),
                    max(col_v, 0),
                    0,
                )
            )
            row_adapter.append(ad_index)
            for m0 in range(0, n_q * group, block_m):
                last = row.q_start + min(n_q - 1, (m0 + block_m - 1) // group)  # last query position
                visible = (
                    n_keys
                    if last >= row.reads[-1].end - 1
                    else sum(max(0, min(r.end, last + 1) - r.start) for r in row.reads)
                )
                tiles.append((i, m0, visible, 0))
            key_off += n_keys
        as_int = {"dtype": torch.int32, "device": device}
        key_slot = _ranges(starts, lens).to(**as_int)
        for off, idx in gathered:
            key_slot[off : off + idx.numel()] = idx
        rank_k, rank_v = _row_ranks(adapters, row_adapter, meta, c.num_layers)
        r_pad = _pow2_at_least_16(max((a.rank for a in adapters), default=1))
        return _Prepared(
            pool=meta.rows[0].reads[0].pool,
            key_slot=key_slot,
            key_pos=_ranges(pos_starts, lens).to(**as_int),
            key_lr=torch.repeat_interleave(torch.tensor(flags, dtype=torch.int8), torch.tensor(lens)).to(
                device
            ),
            rows=torch.tensor(rows, **as_int),
            rank_k=rank_k.to(**as_int),
            rank_v=rank_v.to(**as_int),
            tiles=torch.tensor(tiles, **as_int),
            b=self._adapter_stack(adapters, model, r_pad) if adapters else None,
            r_pad=r_pad,
            block_m=block_m,
            n_splits=self._splits(len(tiles) * c.num_kv_heads, max(t[2] for t in tiles), device),
            windows=tuple(getattr(meta.rows[0], "window", None) or (None,) * c.num_layers),
            has_k=bool(rank_k.any()),
            has_v=bool(rank_v.any()),
        )

    def _splits(self, programs: int, max_keys: int, device: torch.device) -> int:
        """Key splits per program: enough programs for two waves of the GPU's multiprocessors, each
        split at least four key tiles long."""
        if self.num_splits is not None:
            return self.num_splits
        if device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(math.ceil(2 * sms / programs), max_keys // (4 * self.block_n)))

    @staticmethod
    def _compile_options(q: torch.Tensor, block_m: int) -> dict:
        """Warps and pipeline stages on a GPU (FlashAttention-2's Triton settings for these tiles);
        none for the interpreter."""
        if not q.is_cuda:
            return {}
        return {"num_warps": 8 if block_m == 128 else 4, "num_stages": 3 if block_m >= 64 else 2}

    # -- per layer -------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, layer: int, meta: BatchMetadata, model) -> torch.Tensor:
        """Attention of every row at ``layer``: ``q`` ``[N, n_heads, head_dim]`` -> ``[N, n_heads * head_dim]``."""
        if self._meta is not meta:
            reason = self._refusal(q, meta)
            self._meta, self._prepared = meta, None if reason else self._prepare(q, meta, model)
            if reason and reason not in self.refused:
                self.refused.add(reason)
                logger.info("triton attention backend: %s; this forward runs the torch reference", reason)
        if self._prepared is None:
            return self._torch.forward(q, layer, meta, model)
        return self._launch(q, layer, self._prepared, model)

    def _launch(self, q: torch.Tensor, layer: int, p: _Prepared, model) -> torch.Tensor:
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
            D_PAD=_pow2_at_least_16(d),
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
