"""Decode speed with and without a JSON-schema constraint, in one run (issue 21): SmolLM2, the
``qv`` plan adapter, PreLRShared, batch 1 and 16, 3 repeats each; prints one JSON line per
(batch, side) with decode tokens/s min / median / max.

Every turn decodes ``--tokens`` tokens: the unconstrained side with ``ignore_eos``, the
constrained side under a schema whose one string field is ``4 * tokens`` characters long (a token
holds fewer than 4 characters here), so neither side ends before ``max_new_tokens``.

Usage: python benchmarks/structured_decode.py [--tokens 64] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import precache
from precache.config import StructuredOutput
from precache.resources import adapter_set

ASK = "<|im_start|>user\nWrite a long note as JSON.<|im_end|>\n<|im_start|>assistant\n"


def _run(engine, batch: int, tokens: int, spec: StructuredOutput | None) -> float:
    """Decode tokens/s of one batch: generated tokens after each turn's first / the wall time of
    the decode steps (from the last first token to the end)."""
    requests = []
    for _ in range(batch):
        s = engine.session()
        s.append(ASK)
        requests.append(
            s.submit("plan", max_new_tokens=tokens, temperature=0.0, ignore_eos=True, structured_output=spec)
        )
    turns = engine.wait_all(requests)
    start = max(r.t_first for r in requests)
    end = max(r.t_end for r in requests)
    steps = min(len(t.token_ids) for t in turns) - 1
    for s in requests:
        s.session.close()
    return batch * steps / (end - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = precache.Engine(
        precache.load_model(), adapters={"plan": adapter_set("qv", ["plan"])["plan"]}, method="prelrshared"
    )
    length = 4 * args.tokens
    schema = {
        "type": "object",
        "properties": {"note": {"type": "string", "minLength": length, "maxLength": length}},
        "required": ["note"],
        "additionalProperties": False,
    }
    sides = {"none": None, "json_schema": StructuredOutput.json_schema(schema)}
    _run(engine, 2, 8, sides["json_schema"])  # warm-up: tokenizer tables, grammar compile
    for batch in (1, 16):
        for name, spec in sides.items():
            rates = [_run(engine, batch, args.tokens, spec) for _ in range(args.repeats)]
            print(
                json.dumps(
                    {
                        "batch": batch,
                        "constraint": name,
                        "decode_tok_s": [
                            round(min(rates), 2),
                            round(statistics.median(rates), 2),
                            round(max(rates), 2),
                        ],
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
