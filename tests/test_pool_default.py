"""The default block pool on a GPU takes at most a share of the free memory (vLLM sizes its KV
cache the same way); on the CPU it is the full-context default."""

import torch

from precache.methods import sizing


def test_cpu_pool_takes_the_full_context_default():
    assert sizing.device_capped(123_456_789, "cpu") == 123_456_789


def test_cuda_pool_is_capped_by_free_memory(monkeypatch):
    free = 10 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    assert sizing.device_capped(64 * 2**30, "cuda:0") == int(free * sizing.GPU_POOL_SHARE)
    assert sizing.device_capped(2**30, "cuda") == 2**30  # under the cap: unchanged
