"""The torch attention backend alone at a decode step: ``B`` one-query rows over ``n`` keys each,
every layer of SmolLM2's shape, batched decode buckets against the per-row path, interleaved.

The pool holds random K/V/LR values; each row's blocks lie in one run (read in place by the
per-row path, as after a prefill); the key cap of the buckets (``decode_batch.batch_max_keys``)
is lifted, since this measures where it should sit; every row reads its whole context as a base
view plus the ``action`` agent's rank-8 v_proj LR columns (PreLRShared's decode read). Prints min and median
wall time over 5 rounds of one call per layer.

    python benchmarks/decode_attention_micro.py 16 1024 2   # batch, context, torch threads
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import precache
from precache.cache.attention import BatchMetadata, RowAttention, TorchBackend, decode_batch
from precache.cache.pool import KVPool, LRView, PagedStore
from precache.cache.rowplan import View
from precache.cache.views import view_reads
from precache.lora.adapter import LoRAAdapter


def main() -> None:
    B, n = int(sys.argv[1]), int(sys.argv[2])
    decode_batch.BATCH_MAX_KEYS = decode_batch.BATCH_MAX_KEYS_ONE_THREAD = 1 << 30  # no cap
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    model = precache.load_model()
    c = model.config
    g = torch.Generator().manual_seed(0)
    rank = 8
    weights = {
        (layer, "v_proj"): (
            torch.randn(c.hidden_size, rank, generator=g) * 0.05,
            torch.randn(rank, c.num_kv_heads * c.head_dim, generator=g) * 0.05,
        )
        for layer in range(c.num_layers)
    }
    adapter = LoRAAdapter("action", rank, 2.0 * rank, 2.0, frozenset({"v_proj"}), weights)
    ranks = {"action": (0, rank)}
    probe = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, ranks, 1 << 30, 16)
    pool = KVPool(
        c.num_layers, c.num_kv_heads, c.head_dim, ranks, (B * (n // 16 + 2) + 4) * probe.block_bytes, 16
    )
    pool.k.normal_()
    pool.v.normal_()
    pool.lr.normal_()
    rows = []
    for b in range(B):
        store = PagedStore(pool)
        for _ in range(pool.blocks_for(n)):  # each trajectory in one run of blocks, as a prefill lays it
            store.blocks.append(pool.allocator.allocate(after=store.blocks[-1] if store.blocks else None))
        store.commit(n)
        reads = tuple(view_reads(model, View(store, 0, n, LRView(store, "action", n), adapter), True))
        rows.append(RowAttention(slice(b, b + 1), n - 1, reads))
    q = torch.randn(B, c.num_heads, c.head_dim)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(5):
        for batched in (True, False):
            meta = BatchMetadata(tuple(rows), B)
            backend = TorchBackend(batch_decode=batched)
            backend.prepare(meta, model)
            t0 = time.perf_counter()
            for layer in range(c.num_layers):
                backend.forward(q, layer, meta, model)
            times[batched].append(1000 * (time.perf_counter() - t0))
    for batched, t in times.items():
        side = "batched" if batched else "per-row"
        print(
            f"B={B} n={n} {side}: min {min(t):.1f} median {statistics.median(t):.1f} ms over {c.num_layers} layers"
        )


if __name__ == "__main__":
    main()
