"""Decode tokens/s of one session at a 4,000-token context: run it under two checkouts to A/B them.

git worktree add /tmp/old 267a57e   # the code before the engine core
for i in 1 2 3; do for tree in /tmp/old .; do
  PYTHONPATH=$tree HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/decode_ab.py prelrshared; done; done
"""

import sys
from pathlib import Path

import torch

import precache

torch.set_num_threads(2)
method = sys.argv[1] if len(sys.argv) > 1 else "prelrshared"
root = Path(__file__).resolve().parents[1] / "precache" / "assets" / "adapters" / "smollm2-135m" / "qv"
model = precache.load_model()
engine = precache.Engine(model, adapters={a: root / a for a in ("plan", "action", "reflect")}, method=method)
session = engine.session()
session.append(torch.randint(10, 10000, (4000,), generator=torch.Generator().manual_seed(0)).tolist())
session.generate("plan", max_new_tokens=4, ignore_eos=True)
session.append([11, 12])
turn = session.generate("plan", max_new_tokens=48, ignore_eos=True)
print(f"{precache.__file__}: {method} decode {(len(turn.token_ids) - 1) / turn.decode_s:.2f} tok/s")
