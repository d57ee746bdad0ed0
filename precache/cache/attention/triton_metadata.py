"""What the ``triton`` kernel reads about one forward, built once by
:meth:`~precache.cache.attention.triton_backend.TritonBackend.prepare` and kept on the
:class:`~precache.cache.attention.base.BatchMetadata` for every layer.

From the rows' reads: a slot table (the pool row of every key, row after row), the keys'
positions and LR flags, one record per row, the query tiles with the keys each may see, the LR
ranks per layer and row, and the adapters' ``B`` stacked per layer (scaled, and RoPE's
rotate-half of ``B^k``). Built on the host in a few vectorised ops, copied to the device once.
Or, for a forward the kernel cannot run, a :class:`Refusal` naming why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from precache.cache.attention.base import BatchMetadata, RowAttention


@dataclass(frozen=True)
class TritonMetadata:
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


@dataclass(frozen=True)
class Refusal:
    """A forward the kernel cannot run (the torch reference runs it): ``reason`` says why."""

    reason: str


def pow2_at_least_16(n: int) -> int:
    """The smallest power of two >= ``n`` and >= 16 (Triton tile sizes)."""
    return max(16, 1 << max(0, n - 1).bit_length())


#: Query slots per tile above which the kernel's k-side LR term is refused on CUDA. On an H200
#: (torch 2.11, Triton 3.6, 2026-12-04) every tile of more than 16 slots that adds ``RoPE(s Lk B^k)``
#: faulted ("out-of-range shared or local address" at the key load, compute-sanitizer) or, when it
#: ran, scored 0.06-0.09 away from the torch reference in bf16 (0.002 without it); 16-slot tiles
#: (decode rows) matched. benchmarks/RESULTS.md, "GPU".
K_LR_MAX_CUDA_SLOTS = 16


def block_m_for(meta: BatchMetadata, model) -> int:
    """Query slots per tile of this forward, from its largest row (queries x GQA group)."""
    c, device = model.config, torch.device(model.device)
    max_slots = max(
        (row.q_rows.stop - row.q_rows.start) * (c.num_heads // c.num_kv_heads) for row in meta.rows
    )
    return 16 if max_slots <= 16 else 128 if device.type == "cuda" and max_slots >= 1024 else 64


def refusal(meta: BatchMetadata, model) -> str | None:
    """Why the kernel cannot run this forward (None: it can). One pass over the reads."""
    pool = meta.rows[0].reads[0].pool
    if pool.k.dtype != model.dtype:
        return f"queries are {model.dtype} but the pool holds {pool.k.dtype}"
    on_cuda = torch.device(model.device).type == "cuda"
    wide_cuda_tiles = on_cuda and block_m_for(meta, model) > K_LR_MAX_CUDA_SLOTS
    window = meta.rows[0].window
    for row in meta.rows:
        if row.window != window:
            return "rows have different sliding windows"
        first = None
        for read in row.reads:
            if read.pool is not pool:
                return "the rows read several pools"
            if read.lr_cols is None:
                continue
            if wide_cuda_tiles and read.adapter is not None and "k_proj" in read.adapter.targets:
                return (
                    f"the k-side LR term on tiles of more than {K_LR_MAX_CUDA_SLOTS} query slots faults "
                    "on CUDA (Triton 3.6, H200)"
                )
            if first is None:
                first = read
            elif read.adapter is not first.adapter or read.lr_cols != first.lr_cols:
                return "a row reads the LR caches of two adapters"
    return None


def _ranges(starts: list[int], lens: list[int]) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lens)])`` in a few vectorised ops (a decode
    batch reads thousands of block runs)."""
    lens_t = torch.tensor(lens, dtype=torch.int64)
    first = torch.cumsum(lens_t, 0) - lens_t  # where each range begins in the output
    shift = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64) - first, lens_t)
    return torch.arange(int(lens_t.sum())) + shift


@dataclass
class _Tables:
    """The host-side lists of one forward's tables, filled row by row (:meth:`add_row`)."""

    group: int  # query heads per kv head
    block_m: int  # query slots per tile
    starts: list[int] = field(default_factory=list)  # per read: first pool row (0: scattered)
    lens: list[int] = field(default_factory=list)  # per read: keys
    pos_starts: list[int] = field(default_factory=list)  # per read: first position
    flags: list[int] = field(default_factory=list)  # per read: 1 where it adds the LR part
    gathered: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (key offset, pool rows)
    rows: list[tuple[int, ...]] = field(default_factory=list)  # per row: TritonMetadata.rows
    tiles: list[tuple[int, ...]] = field(default_factory=list)  # per tile: TritonMetadata.tiles
    row_adapter: list[int] = field(default_factory=list)  # per row: index into adapters, -1: none
    adapters: list = field(default_factory=list)  # adapters with LR reads, in order of first read
    widths: list[tuple[int, int]] = field(default_factory=list)  # per adapter: LR columns of k, v
    keys: int = 0  # keys of the rows added so far

    def add_row(self, i: int, row: RowAttention) -> None:
        key_off, ad_index, col_k, col_v = self.keys, -1, -1, -1
        for read in row.reads:
            if isinstance(read.rows, slice):
                self.starts.append(read.rows.start)
            else:  # scattered pool rows, already on the device: copied into the slot table
                self.starts.append(0)
                self.gathered.append((self.keys, read.rows))
            self.lens.append(read.end - read.start)
            self.keys += read.end - read.start
            self.pos_starts.append(read.start)
            self.flags.append(int(read.lr_cols is not None and read.adapter is not None))
            if self.flags[-1]:
                if not any(a is read.adapter for a in self.adapters):
                    self.adapters.append(read.adapter)
                    self.widths.append(tuple(cols.stop - cols.start for cols in read.lr_cols))
                ad_index = next(j for j, a in enumerate(self.adapters) if a is read.adapter)
                col_k, col_v = read.lr_cols[0].start, read.lr_cols[1].start
        n_q = row.q_rows.stop - row.q_rows.start
        self.rows.append(
            (key_off, row.q_rows.start, n_q, row.q_start, max(ad_index, 0), max(col_k, 0), max(col_v, 0), 0)
        )
        self.row_adapter.append(ad_index)
        self._add_tiles(i, row, n_q, self.keys - key_off)

    def _add_tiles(self, i: int, row: RowAttention, n_q: int, n_keys: int) -> None:
        """The row's query tiles, each with the keys its last query may see (causal)."""
        group, block_m = self.group, self.block_m
        for m0 in range(0, n_q * group, block_m):
            last = row.q_start + min(n_q - 1, (m0 + block_m - 1) // group)  # last query position
            visible = (
                n_keys
                if last >= row.reads[-1].end - 1
                else sum(max(0, min(r.end, last + 1) - r.start) for r in row.reads)
            )
            self.tiles.append((i, m0, visible, 0))


def _row_ranks(tables: _Tables, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rank_k, rank_v)`` ``[num_layers, n_rows]``: the LR columns a row's adapter adds at each
    layer (0 for a row without LR reads, or a layer where the adapter has no LoRA on k / v)."""
    table = torch.zeros(2, num_layers, len(tables.adapters) + 1, dtype=torch.int64)  # last column: no adapter
    for j, (adapter, widths) in enumerate(zip(tables.adapters, tables.widths, strict=True)):
        for layer in range(num_layers):
            for side, proj in enumerate(("k_proj", "v_proj")):
                table[side, layer, j] = widths[side] if adapter.has(layer, proj) else 0
    index = torch.tensor(tables.row_adapter, dtype=torch.int64)  # -1 picks the last column
    return table[0][:, index], table[1][:, index]


def _adapter_stacks(adapters: list, model, r_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sB^k, rot(sB^k), sB^v)`` ``[n_layers, n_adapters, Hkv, r_pad, D]`` (zeros where a layer
    has no LoRA on the projection), ``rot`` = RoPE's rotate-half on each head's columns, from each
    adapter's own stacks (:meth:`~precache.lora.adapter.LoRAAdapter.up_stack`, built once)."""
    c = model.config
    d = c.head_dim

    def stacked(proj: str) -> torch.Tensor:
        per = []
        for adapter in adapters:
            if proj in adapter.targets:
                up = adapter.up_stack(proj, c.num_layers, c.num_kv_heads)  # [L, Hkv, rank, D]
                per.append(torch.nn.functional.pad(up, (0, 0, 0, r_pad - up.shape[2])))
            else:
                per.append(
                    torch.zeros(
                        c.num_layers, c.num_kv_heads, r_pad, d, dtype=model.dtype, device=model.device
                    )
                )
        return torch.stack(per, dim=1).to(model.dtype)

    bk, bv = stacked("k_proj"), stacked("v_proj")
    half = d // 2
    bkrot = torch.cat((-bk[..., half:], bk[..., :half]), dim=-1)
    return bk, bkrot, bv


def _splits(programs: int, max_keys: int, device: torch.device, block_n: int, num_splits: int | None) -> int:
    """Key splits per program (flash-decoding): ``num_splits`` when given; else enough programs for
    two waves of the GPU's multiprocessors, each split at least four key tiles long (1 off CUDA)."""
    if num_splits is not None:
        return num_splits
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(math.ceil(2 * sms / programs), max_keys // (4 * block_n)))


def build(meta: BatchMetadata, model, block_n: int, num_splits: int | None) -> TritonMetadata:
    """The kernel inputs of one forward whose :func:`refusal` is None (``block_n``: the key tile,
    ``num_splits``: as :class:`~precache.cache.attention.triton_backend.TritonBackend` takes it)."""
    c, device = model.config, torch.device(model.device)
    group = c.num_heads // c.num_kv_heads
    block_m = block_m_for(meta, model)
    tables = _Tables(group, block_m)
    for i, row in enumerate(meta.rows):
        tables.add_row(i, row)
    as_int = {"dtype": torch.int32, "device": device}
    key_slot = _ranges(tables.starts, tables.lens).to(**as_int)
    for off, idx in tables.gathered:
        key_slot[off : off + idx.numel()] = idx
    rank_k, rank_v = _row_ranks(tables, c.num_layers)
    adapters = tables.adapters
    r_pad = pow2_at_least_16(max((a.rank for a in adapters), default=1))
    lens = torch.tensor(tables.lens)
    return TritonMetadata(
        pool=meta.rows[0].reads[0].pool,
        key_slot=key_slot,
        key_pos=_ranges(tables.pos_starts, tables.lens).to(**as_int),
        key_lr=torch.repeat_interleave(torch.tensor(tables.flags, dtype=torch.int8), lens).to(device),
        rows=torch.tensor(tables.rows, **as_int),
        rank_k=rank_k.to(**as_int),
        rank_v=rank_v.to(**as_int),
        tiles=torch.tensor(tables.tiles, **as_int),
        b=_adapter_stacks(adapters, model, r_pad) if adapters else None,
        r_pad=r_pad,
        block_m=block_m,
        n_splits=_splits(
            len(tables.tiles) * c.num_kv_heads, max(t[2] for t in tables.tiles), device, block_n, num_splits
        ),
        windows=tuple(meta.rows[0].window or (None,) * c.num_layers),
        has_k=bool(rank_k.any()),
        has_v=bool(rank_v.any()),
    )
