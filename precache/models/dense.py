"""The cache-free reference forward: each row attends over its own adapted K/V, nothing cached.

Any model family runs it (it only reads the :class:`~precache.models.contract.LayerInput` the
family hands each layer); tests and the figure-2 study compare the engine's caches against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from precache.models.contract import LayerInput, Row


class DenseAttention:
    """Cache-free causal self-attention of each row over its own adapted K/V (a
    :class:`~precache.models.contract.LayerAttention`).

    The reference full-sequence forward: no cache is read or written. A layer with a sliding
    window (``config.window(layer)``) masks key positions ``p <= t - window`` for query ``t``.
    """

    def __init__(self, rows: list[Row]):
        self.rows = rows

    def attend(self, x: LayerInput) -> torch.Tensor:
        out = torch.empty(x.q.shape[0], x.q.shape[1] * x.q.shape[2], dtype=x.q.dtype, device=x.q.device)
        window = x.model.config.window(x.layer)
        for row in self.rows:
            k, v = x.adapted_kv(row.slice, row.adapter)
            q = x.q[row.slice].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
            n = row.end - row.start
            mask = None
            if window is not None and n > window:
                pos = torch.arange(n, device=q.device)
                delta = pos[:, None] - pos[None, :]  # query minus key position
                mask = (delta >= 0) & (delta < window)  # [n, n]
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
            out[row.slice] = o[0].transpose(0, 1).reshape(n, -1)
        return out


def dense_logits(model, sequences: list[list[int]], adapters: list | None = None) -> list[torch.Tensor]:
    """Logits ``[len(seq), vocab]`` of every position of each sequence, all run as one mixed batch
    through ``model.forward`` (any registered family) with :class:`DenseAttention`.

    ``adapters[i]`` is sequence i's adapter (None: base model). Positions start at 0 in each row.
    """
    adapters = adapters or [None] * len(sequences)
    rows, start = [], 0
    for seq, adapter in zip(sequences, adapters, strict=True):
        rows.append(Row(start, start + len(seq), adapter))
        start += len(seq)
    ids = torch.tensor([t for seq in sequences for t in seq], device=model.device)
    positions = torch.cat([torch.arange(len(seq), device=model.device) for seq in sequences])
    logits = model.forward(ids, positions, rows, DenseAttention(rows), logits_at=list(range(start)))
    return [logits[row.slice] for row in rows]
