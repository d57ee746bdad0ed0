"""Test set-up: one intra-op thread (tiny matrices gain nothing from more, and OpenMP spinning
on a shared 2-core machine costs seconds), quiet HF hub access."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# models load eager unless a test asks for the compiled decode step (tests/test_step_graph.py):
# the eager forward is the oracle, and a compile per tiny model would cost the suite minutes
os.environ.setdefault("PRECACHE_EAGER", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402

from tests.tiny import AGENTS, save_random_adapter, tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``(model, adapters, zero-B adapters)``: a 3-layer random Llama and three random adapters
    (ranks 4, 8, 2 on q, k, v, o), plus three with LoRA B = 0."""
    model, hf = tiny_model("llama", seed=0, num_layers=3)
    root = tmp_path_factory.mktemp("adapters")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    dirs = {
        a: save_random_adapter(hf, root / a, targets=targets, r=r, seed=i + 1)
        for i, (a, r) in enumerate(zip(AGENTS, (4, 8, 2), strict=True))
    }
    zero = {
        a: save_random_adapter(hf, root / f"zero-{a}", targets=targets, r=4, seed=i + 7, zero_b=True)
        for i, a in enumerate(AGENTS)
    }
    return model, dirs, zero
