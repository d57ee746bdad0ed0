"""Test set-up: one intra-op thread (tiny matrices gain nothing from more, and OpenMP spinning
on a shared 2-core machine costs seconds), quiet HF hub access."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
