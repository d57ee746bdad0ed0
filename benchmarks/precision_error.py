"""bf16 or int8 weights, or a bf16 KV cache, against fp32 on CPU: decode speed and the error, on
HotpotQA dev episodes.

Two engines over the embedded SmolLM2 (``load_model(dtype=float32)`` and, with ``--against
bf16`` (default), ``dtype=bfloat16`` (the KV caches follow the compute dtype) or, with
``--against int8`` / ``int4``, ``quantization="int8"`` / ``"int4"`` (weight-only; compute and KV
caches stay fp32), or,
with ``--against kv-bf16``, fp32 weights and compute over a bf16 block pool (``kv_cache_dtype``)),
the committed ``qv`` adapters, one sharing method (default PreLRShared). Each of the first
``--questions`` dev questions runs as a greedy episode on both. Reported:

- logit error of the first turn (the plan agent over the same header on both): max |fp32 - other|
  of the logits, KL(fp32 || other) of the next-token distributions, whether the top-1 agrees;
- greedy agreement: episodes whose every turn is identical, identical final answers, EM of each;
- decode tokens/s of each (all decode tokens over all decode time, single stream).

    python benchmarks/precision_error.py --questions 10 --threads 2 [--against int8 | int4 | kv-bf16]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import precache
from precache.agents.data import load_questions
from precache.agents.loop import run_episode
from precache.resources import adapter_set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--method", default="prelrshared")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", default="bf16", choices=("bf16", "int8", "int4", "kv-bf16"))
    args = parser.parse_args()
    other = {
        "bf16": {"dtype": torch.bfloat16},
        "int8": {"dtype": torch.float32, "quantization": "int8"},
        "int4": {"dtype": torch.float32, "quantization": "int4"},
        "kv-bf16": {"dtype": torch.float32, "kv_cache_dtype": "bfloat16"},
    }[args.against]
    torch.set_num_threads(args.threads)
    engines = {
        name: precache.Engine(
            precache.load_model(**options),
            adapters=adapter_set("qv"),
            method=args.method,
            prefix_caching=False,
        )
        for name, options in (("fp32", {"dtype": torch.float32}), (args.against, other))
    }
    rows, speed = [], {name: [0, 0.0] for name in engines}
    for question in load_questions("dev")[: args.questions]:
        episodes = {}
        for name, engine in engines.items():
            episodes[name] = episode = run_episode(engine.session(), question)
            for turn in episode.turns:
                speed[name][0] += max(0, len(turn.token_ids) - 1)
                speed[name][1] += turn.decode_s
        a, b = episodes["fp32"], episodes[args.against]
        la, lb = a.turns[0].first_logits.float(), b.turns[0].first_logits.float()
        kl = F.kl_div(F.log_softmax(lb, -1), F.log_softmax(la, -1), log_target=True, reduction="sum").item()
        same = [x.token_ids == y.token_ids for x, y in zip(a.turns, b.turns, strict=False)]
        rows.append(
            {
                "max_abs": (la - lb).abs().max().item(),
                "kl": kl,
                "top1": int(la.argmax() == lb.argmax()),
                "identical": int(all(same) and len(a.turns) == len(b.turns)),
                "first_diverging_turn": same.index(False) if False in same else None,
                "same_answer": int(a.answer == b.answer),
                "em": (a.em, b.em),
            }
        )
    n = len(rows)
    print(f"{n} HotpotQA dev questions, {args.method}, qv adapters, {args.threads} threads")
    print("| measure | value |")
    print("|---|---|")
    print(
        f"| first-turn logits, max abs error (median / max) | "
        f"{sorted(r['max_abs'] for r in rows)[n // 2]:.3f} / {max(r['max_abs'] for r in rows):.3f} |"
    )
    print(
        f"| first-turn KL(fp32 || {args.against}), nats (median / max) | "
        f"{sorted(r['kl'] for r in rows)[n // 2]:.4f} / {max(r['kl'] for r in rows):.4f} |"
    )
    print(f"| first-turn top-1 agreement | {sum(r['top1'] for r in rows)}/{n} |")
    print(f"| episodes identical in every turn | {sum(r['identical'] for r in rows)}/{n} |")
    print(f"| identical final answers | {sum(r['same_answer'] for r in rows)}/{n} |")
    print(
        f"| EM fp32 / {args.against} | {sum(r['em'][0] for r in rows) / n:.2f} / {sum(r['em'][1] for r in rows) / n:.2f} |"
    )
    for name, (tokens, seconds) in speed.items():
        print(f"| decode tokens/s, {name} | {tokens / seconds:.1f} |")
    print("first diverging turn per question:", [r["first_diverging_turn"] for r in rows])


if __name__ == "__main__":
    main()
