"""The block pool a sharing method's caches live in, sized from a byte budget before the method is
built (the engine builds it, :func:`precache.methods.build_pool`, and hands it to the method).

A method that splits K/V into base + LR (:attr:`SharingMethod.splits_kv
<precache.methods.base.SharingMethod.splits_kv>`) needs LR columns in every block for each
agent, ``r_k + r_v`` wide (:func:`lr_ranks`), plus spare slots for adapters added later; the other
methods need none. The default budget holds ``n_agents + 2`` caches at the context length.
"""

from __future__ import annotations

import logging

import torch

from precache.cache.pool import DEFAULT_BLOCK_SIZE, KVPool
from precache.errors import AdapterError
from precache.lora.adapter import LoRAAdapter

logger = logging.getLogger(__name__)

#: share of a GPU's free memory the default block pool may take (the rest: activations, logits)
GPU_POOL_SHARE = 0.85


def device_capped(nbytes: int, device: torch.device | str) -> int:
    """``nbytes``, or at most :data:`GPU_POOL_SHARE` of ``device``'s free memory on CUDA (measured
    with ``torch.cuda.mem_get_info`` after the weights are loaded, as vLLM sizes its KV cache from
    ``gpu_memory_utilization``). Host memory is not probed: a CPU pool takes ``nbytes``."""
    device = torch.device(device)
    if device.type != "cuda":
        return nbytes
    free, _total = torch.cuda.mem_get_info(device)
    cap = int(free * GPU_POOL_SHARE)
    if cap < nbytes:
        logger.info(
            "default KV pool capped at %.1f GiB (%.0f%% of free GPU memory)",
            cap / 2**30,
            100 * GPU_POOL_SHARE,
        )
    return min(nbytes, cap)


def lr_ranks(adapter: LoRAAdapter) -> tuple[int, int]:
    """``(r_k, r_v)``: the LR cache columns an adapter needs (0 where it leaves k or v alone)."""
    return (
        adapter.rank if "k_proj" in adapter.targets else 0,
        adapter.rank if "v_proj" in adapter.targets else 0,
    )


def check_splittable(method: str, model_config, agent: str, adapter: LoRAAdapter) -> None:
    """Refuse an adapter whose key a method that splits K/V cannot split (``method``: its name).

    Raises:
        AdapterError: a k_proj LoRA on a model with a per-head k-norm (Qwen3): the norm of
            ``k + s h A^k B^k`` is not the norm of ``k`` plus an LR term.
    """
    if model_config.qk_norm and "k_proj" in adapter.targets:
        raise AdapterError(
            f"adapter '{agent}' has a k_proj LoRA; under {method} the key is split into base + LR, "
            f"which the per-head k-norm of {model_config.model_type} does not allow (use v/q/o/MLP targets)"
        )


def _check_count(what: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")


def pool_for(
    splits_kv: bool,
    model,
    adapters: dict[str, LoRAAdapter],
    kv_cache_bytes: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    spare_lr_slots: int = 0,
    spare_lr_rank: int = 0,
    kv_cache_dtype: torch.dtype | None = None,
) -> KVPool:
    """The :class:`~precache.cache.pool.KVPool` of a method (``splits_kv``: with LR columns for
    each of ``adapters`` and ``spare_lr_slots`` more of ``spare_lr_rank`` key and value columns
    each) on ``model``'s device: ``kv_cache_bytes`` bytes (None: room for ``len(adapters) + 2``
    caches at the context length, capped on a GPU by :func:`device_capped`), in blocks of
    ``block_size`` tokens, entries at ``kv_cache_dtype`` (None: the model's dtype).

    Raises:
        ValueError: ``spare_lr_slots`` / ``spare_lr_rank`` not an integer >= 0, ``block_size`` not
            an integer >= 1, or ``kv_cache_bytes`` not an integer.
        CacheCapacityError: ``kv_cache_bytes`` holds no block.
    """
    _check_count("spare_lr_slots", spare_lr_slots, 0)
    _check_count("spare_lr_rank", spare_lr_rank, 0)
    if not splits_kv:
        spare_lr_slots = spare_lr_rank = 0  # no LR columns to reserve
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 (tokens per block), got {block_size!r}")
    if kv_cache_bytes is not None and (
        isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int)
    ):
        raise ValueError(f"kv_cache_bytes must be an integer number of bytes, got {kv_cache_bytes!r}")
    c, cache_dtype = model.config, kv_cache_dtype or model.dtype
    ranks = {a: lr_ranks(ad) for a, ad in adapters.items()} if splits_kv else {}
    if kv_cache_bytes is None:  # a full-context trajectory fits under every method
        itemsize = torch.finfo(cache_dtype).bits // 8
        lr_width = sum(map(sum, ranks.values())) + 2 * spare_lr_slots * spare_lr_rank
        token_bytes = c.num_layers * (2 * c.num_kv_heads * c.head_dim + lr_width)
        blocks = (len(adapters) + 2) * -(-model.max_context // block_size)
        kv_cache_bytes = device_capped(blocks * block_size * token_bytes * itemsize, model.device)
    return KVPool(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        ranks,
        kv_cache_bytes,
        block_size,
        cache_dtype,
        model.device,
        spare_lr_slots=spare_lr_slots,
        spare_lr_rank=spare_lr_rank,
    )
