"""Why ReBaseShared (and, on unseen questions, ReBaseOwnShared) episodes end at the step limit on
ScienceQA (issue 36, item 2): which agent's turn parts from NonShared, what the teacher-forced
errors say there, and whether the engine computes the method's definition (DESIGN.md) or not.

On each ScienceQA dev question given (the committed ``qv`` adapters, greedy, the study's 8 steps
and 64 new tokens):

1. free episodes under every method: stop reason, and the first turn whose text differs from
   NonShared's (agent, NonShared's text, the method's text), and the invalid plan turns;
2. NonShared's trajectory teacher-forced under every method in lockstep with NonShared: per turn
   ``first_kl`` / ``mean_kl`` (nats), top-1 agreement, the first token where the top-1 differs, and
   the K/V error of the view over the agent's own earlier segments and the other agents'
   (:func:`precache.bench.fidelity.split_layer_errors`, mean over layers);
3. a brute-force oracle of the methods' definitions that never reads the engine's caches: dense
   forwards of the model (neutral, and each agent's) and, turn by turn, the reading agent's forward
   over a prefix assembled per position from its definition:
   ``rebaseshared``: ``Kb(h^0) + LoRA(h^src)`` with ``h^src`` the author's own hidden state on the
   reader's own segments and ``h^0`` elsewhere; ``rebaseownshared``: the reader's own earlier turns'
   exact K/V and ``Kb(h^0) + LoRA(h^0)`` elsewhere; ``own-only`` (an ablation, no engine method):
   ReBaseShared's reading of the reader's own segments and NonShared's of the others'. Reported:
   max |engine - oracle| of the logits (the engine computes the definition when this is at float
   rounding) and each policy's KL against NonShared per turn.

    PRECACHE_EAGER=1 python benchmarks/step_limit_diagnosis.py --threads 1 \
        --ids 10330,1083,12776 --json benchmarks/results/step_limit_diagnosis.json

writes the JSON and ``step_limit_diagnosis.md`` beside it (``--report-only``: the markdown from the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import torch

import precache
from precache.agents.benchmark import get_benchmark
from precache.agents.loop import run_episode
from precache.agents.scienceqa_tools import gold_trajectory
from precache.bench.episodes import RecordingSession
from precache.bench.fidelity import forced_turn, kl_top1, split_layer_errors
from precache.lora.adapter import load_adapter
from precache.models import Row
from precache.resources import adapter_set

ROLES = ("plan", "action", "reflect")
METHODS = ("nonshared", "fullshared", "prelrshared", "rebaseshared-lp", "rebaseownshared-lp")
POLICIES = ("rebaseshared", "rebaseownshared", "own-only")
ENGINE_OF = {"rebaseshared": "rebaseshared-lp", "rebaseownshared": "rebaseownshared-lp"}
SEED = 0


class _PrefixAttention:
    """One dense row reading a materialised prefix ``[(K, V)]`` per layer (``[P, Hkv, D]`` each),
    causal over its own tokens; records the attention input ``h`` and the row's K/V per layer."""

    def __init__(self, adapter, prefix):
        self.adapter, self.prefix = adapter, prefix
        self.h, self.kv = [], []

    def attend(self, x) -> torch.Tensor:
        self.h.append(x.h.clone())
        k, v = x.adapted_kv(slice(None), self.adapter)
        self.kv.append((k.clone(), v.clone()))
        pk, pv = self.prefix[x.layer]
        keys, values = torch.cat([pk, k]), torch.cat([pv, v])  # [P + T, Hkv, D]
        T, Hq, D = x.q.shape
        group = Hq // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("thd,nhd->htn", x.q, keys) / math.sqrt(D)
        P = pk.shape[0]
        visible = torch.arange(P + T)[None, :] <= (P + torch.arange(T))[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("htn,nhd->thd", probs, values).reshape(T, Hq * D)


def dense_run(model, token_ids, pos0, adapter, prefix):
    """``(logits [T, vocab], backend)`` of one row over ``token_ids`` at ``[pos0, pos0 + T)``."""
    backend = _PrefixAttention(adapter, prefix)
    T = len(token_ids)
    rows = [Row(0, T, adapter)]
    logits = model.forward(
        torch.tensor(token_ids), torch.arange(pos0, pos0 + T), rows, backend, list(range(T))
    )
    return logits, backend


def lora_kv(model, layer, h_base, h_lora, adapter, start):
    """``Kb(h_base) + RoPE(s h_lora A^k B^k)``, ``Vb(h_base) + s h_lora A^v B^v`` at ``[start, start + n)``."""
    cos, sin = model.rope.span(start, start + h_base.shape[0])
    k, v = model.finish_kv(layer, *model.qkv(layer, h_base)[1:], cos, sin)  # [n, Hkv, D] each
    if adapter is not None and adapter.has(layer, "k_proj"):
        k = k + model.rope.apply(adapter.delta(h_lora, layer, "k_proj").view(k.shape), cos, sin)
    if adapter is not None and adapter.has(layer, "v_proj"):
        v = v + adapter.delta(h_lora, layer, "v_proj").view(v.shape)
    return k, v


def oracle(model, adapters, token_ids, spans, policy):
    """Per turn ``(agent, start, end)`` (the positions its forward processes): the logits ``[end -
    start, vocab]`` of the reading agent under ``policy`` (module docstring; ``"nonshared"``: every
    earlier position from the reader's own dense forward)."""
    L = model.config.num_layers
    empty = [(torch.zeros(0, model.config.num_kv_heads, model.config.head_dim),) * 2] * L
    n = spans[-1][2]
    _, neutral = dense_run(model, token_ids[:n], 0, None, empty)
    dense = {a: dense_run(model, token_ids[:n], 0, adapters[a], empty)[1] for a in adapters}
    done: list[tuple[str, int, int, _PrefixAttention]] = []
    out = []
    for agent, start, end in spans:
        adapter, prefix = adapters[agent], []
        for layer in range(L):
            h0 = neutral.h[layer][:start]
            if policy == "nonshared":
                k, v = (t[:start] for t in dense[agent].kv[layer])
                prefix.append((k, v))
                continue
            k, v = lora_kv(model, layer, h0, h0, adapter, 0)
            for a, s, e, run in done:
                if a != agent:
                    if policy == "own-only":
                        k[s:e], v[s:e] = (t[s:e] for t in dense[agent].kv[layer])
                elif policy == "rebaseownshared":
                    k[s:e], v[s:e] = run.kv[layer]
                else:  # rebaseshared and own-only: neutral base, LR part from the agent's own h
                    k[s:e], v[s:e] = lora_kv(model, layer, h0[s:e], run.h[layer], adapter, s)
            prefix.append((k, v))
        logits, run = dense_run(model, token_ids[start:end], start, adapter, prefix)
        done.append((agent, start, end, run))
        out.append(logits)
    return out


def turn_spans(turns) -> tuple[list[int], list[tuple[str, int, int]]]:
    """The trajectory's tokens and, per turn, ``(agent, start, end)``: a turn's forward processes
    the appended tokens and every generated token but its last (DESIGN.md, authors)."""
    tokens, spans, start = [], [], 0
    for turn in turns:
        tokens += list(turn.appended) + list(turn.token_ids)
        spans.append((turn.agent, start, len(tokens) - 1))
        start = len(tokens) - 1
    return tokens, spans


def free_runs(engines, question, bench, tok) -> tuple[list, dict]:
    """NonShared's recorded turns, and per method its stop reason and first turn apart from NonShared."""
    out, reference = {}, None
    for name, engine in engines.items():
        session = RecordingSession(engine.session())
        episode = run_episode(session, question, benchmark=bench, max_steps=8, max_new_tokens=64)
        texts = [(t.agent, tok.decode(t.token_ids)) for t in session.turns]
        if reference is None:
            reference, ref_texts = session.turns, texts
        common = min(len(texts), len(ref_texts))
        apart = next((i for i in range(common) if texts[i] != ref_texts[i]), None)
        if apart is None and len(texts) != len(ref_texts):
            apart = common  # one ran past the other's last turn
        invalid = sum(1 for p in episode.pieces if p.role == "env" and "Invalid step" in p.text)
        out[name] = {
            "stop_reason": episode.stop_reason,
            "turns": len(texts),
            "invalid_plan_turns": invalid,
            "first_turn_apart": None
            if apart is None
            else {
                "turn": apart,
                "agent": (texts[apart:] or ref_texts[apart:])[0][0],
                "nonshared": ref_texts[apart][1] if apart < len(ref_texts) else None,
                "method": texts[apart][1] if apart < len(texts) else None,
            },
        }
    return reference, out


def _verdict(tok, turn, ref_logits, logits) -> dict | None:
    """At a reflect turn's verdict token: P(right) and P(wrong) under NonShared and the method."""
    words = {w: tok.encode(w, add_special_tokens=False)[0] for w in ("right", "wrong")}
    i = next((j for j, t in enumerate(turn.token_ids) if t in words.values()), None)
    if turn.agent != "reflect" or i is None:
        return None
    out = {}
    for who, row in (("nonshared", ref_logits[i]), ("method", logits[i])):
        probs = torch.softmax(row.double(), -1)
        out[who] = {w: round(float(probs[t]), 4) for w, t in words.items()}
    return out


def gold_turns(tok, pieces) -> list[SimpleNamespace]:
    """Turn records (``agent``, ``appended``, ``token_ids``) of a gold trajectory's pieces, each
    tokenized on its own as the protocol does (:mod:`precache.agents.prompt`)."""
    turns, pending = [], []
    for piece in pieces:
        ids = tok.encode(piece.text, add_special_tokens=False)
        if piece.role == "env":
            pending += ids
        else:
            turns.append(SimpleNamespace(agent=piece.role, appended=pending, token_ids=ids))
            pending = []
    return turns


def forced_records(engines, turns, tok) -> dict:
    """NonShared's ``turns`` teacher-forced under every engine in lockstep with NonShared."""
    ref = engines["nonshared"].session()
    sessions = {m: e.session() for m, e in engines.items() if m != "nonshared"}
    out, writers, logits_of = {m: [] for m in sessions}, [], {m: [] for m in engines}
    for turn in turns:
        processed = len(ref.authors)
        ref.append(list(turn.appended))
        ref_logits = forced_turn(ref, turn.agent, turn.token_ids)
        logits_of["nonshared"].append(ref_logits)
        own = torch.tensor([w == turn.agent for w in writers[:processed]], dtype=torch.bool)
        for m, session in sessions.items():
            session.append(list(turn.appended))
            logits = forced_turn(session, turn.agent, turn.token_ids)
            logits_of[m].append(logits)
            kl, same = kl_top1(ref_logits, logits)
            i = next((j for j, s in enumerate(same) if not s), None)
            record = {
                "agent": turn.agent,
                "position": processed,
                "first_kl": round(kl[0], 4),
                "mean_kl": round(sum(kl) / len(kl), 4),
                "top1": round(sum(same) / len(same), 3),
                "first_miss": None
                if i is None
                else {
                    "index": i,
                    "context": tok.decode(turn.token_ids[:i]),
                    "nonshared": tok.decode([int(ref_logits[i].argmax())]),
                    "method": tok.decode([int(logits[i].argmax())]),
                    "kl": round(kl[i], 4),
                },
            }
            verdict = _verdict(tok, turn, ref_logits, logits)
            if verdict is not None:
                record["verdict"] = verdict
            if processed:
                parts = {k: v for k, v in (("own", own), ("other", ~own)) if bool(v.any())}
                errs = split_layer_errors(ref, session, turn.agent, processed, parts)
                for part, (k_err, v_err) in errs.items():
                    record[f"k_error_{part}"] = round(sum(k_err) / len(k_err), 4)
                    record[f"v_error_{part}"] = round(sum(v_err) / len(v_err), 4)
            out[m].append(record)
        writers += [turn.agent] * (len(turn.appended) + len(turn.token_ids))
    return out, logits_of


def oracle_records(model, adapters, turns, logits_of) -> dict:
    """Per policy and turn: KL against NonShared's definition at the turn's generated tokens, and
    (policies an engine implements) max |engine - oracle| of their logits."""
    tokens, spans = turn_spans(turns)
    reference = oracle(model, adapters, tokens, spans, "nonshared")
    out = {}
    for policy in ("nonshared", *POLICIES):
        logits = oracle(model, adapters, tokens, spans, policy)
        rows = []
        for i, (turn, (_, start, _)) in enumerate(zip(turns, spans, strict=True)):
            first = (spans[i][2] - start) - len(turn.token_ids)
            ours, ref = logits[i][first:], reference[i][first:]
            kl, same = kl_top1(ref, ours)
            row = {"agent": turn.agent, "first_kl": round(kl[0], 4), "mean_kl": round(sum(kl) / len(kl), 4)}
            row["top1"] = round(sum(same) / len(same), 3)
            engine = ENGINE_OF.get(policy, policy)
            if engine in logits_of:
                row["engine_max_abs"] = float((logits_of[engine][i] - ours).abs().max())
            rows.append(row)
        out[policy] = rows
    return out


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    miss = row.get("first_miss")
    text = f"{row['first_kl']:.3f} / {row['mean_kl']:.3f} / {row['top1']:.2f}"
    if miss is not None:
        text += f" (miss at {miss['context']!r}: {miss['nonshared']!r} -> {miss['method']!r}, KL {miss['kl']:.2f})"
    return text


def markdown(results: dict) -> str:
    """The report: free-run outcomes, the turn where each method parts from NonShared, the
    teacher-forced errors at NonShared's plan turns, and the oracle check."""
    methods = [m for m in results["methods"] if m != "nonshared"]
    lines = [
        "# Step-limit episodes on ScienceQA: where they come from (issue 36, item 2)",
        "",
        f"`{results['adapters']}` adapters, greedy, 8 steps, 64 new tokens; command in the script's docstring.",
        "",
        "## Free runs: stop reason (turns; invalid plan turns) and the first turn apart from NonShared",
        "",
        "| question | " + " | ".join(results["methods"]) + " |",
        "|---" * (len(results["methods"]) + 1) + "|",
    ]
    for qid, q in results["questions"].items():
        cells = []
        for m in results["methods"]:
            f = q["free"][m]
            cell = f"{f['stop_reason']} ({f['turns']}; {f['invalid_plan_turns']})"
            apart = f["first_turn_apart"]
            if apart is not None:
                cell += f": turn {apart['turn']} {apart['agent']} {apart['method']!r}"
            cells.append(cell)
        lines.append(f"| {qid} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## NonShared's trajectory teacher-forced: first-token KL / mean KL / top-1 per turn",
        "",
        "| question | turn | " + " | ".join(methods) + " |",
        "|---" * (len(methods) + 2) + "|",
    ]
    for qid, q in results["questions"].items():
        for i, row in enumerate(q["forced"][methods[0]]):
            cells = [_cell(q["forced"][m][i]) for m in methods]
            lines.append(f"| {qid} | {i} {row['agent']} | " + " | ".join(cells) + " |")
    worst = {
        policy: max(
            r.get("engine_max_abs", 0.0)
            for q in results["questions"].values()
            for part in (q, q["gold_negative"])
            for r in part["oracle"][policy]
        )
        for policy in ("nonshared", "rebaseshared", "rebaseownshared")
    }
    lines += [
        "",
        "## Oracle of the definitions (no engine cache read): mean KL against NonShared per turn",
        "",
        "Largest |engine - oracle| of any logit, every turn of every trajectory (free NonShared and the "
        "gold negative one): " + ", ".join(f"{p} {v:.1e}" for p, v in worst.items()) + ".",
        "",
        "| question | trajectory | " + " | ".join(POLICIES) + " |",
        "|---|---|" + "---|" * len(POLICIES),
    ]
    for qid, q in results["questions"].items():
        for name, part in (("NonShared free", q), ("gold negative", q["gold_negative"])):
            cells = [
                " ".join(f"{r['agent'][:2]} {r['mean_kl']:.3f}" for r in part["oracle"][p]) for p in POLICIES
            ]
            lines.append(f"| {qid} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Reflect verdicts teacher-forced (P(right) / P(wrong), NonShared -> method)", ""]
    lines += [
        "| question | trajectory | turn | " + " | ".join(methods) + " |",
        "|---" * (len(methods) + 3) + "|",
    ]
    for qid, q in results["questions"].items():
        for name, part in (("NonShared free", q), ("gold negative", q["gold_negative"])):
            for i, row in enumerate(part["forced"][methods[0]]):
                if "verdict" not in row:
                    continue
                cells = []
                for m in methods:
                    v = part["forced"][m][i]["verdict"]
                    n, o = v["nonshared"], v["method"]
                    cells.append(f"{n['right']:.2f}/{n['wrong']:.2f} -> {o['right']:.2f}/{o['wrong']:.2f}")
                lines.append(f"| {qid} | {name} | {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ids", default="10330,1083,12776,1340", help="ScienceQA dev pids")
    parser.add_argument("--adapters", default="qv")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="benchmarks/results/step_limit_diagnosis.json")
    parser.add_argument("--report-only", action="store_true", help="rewrite the markdown from --json")
    args = parser.parse_args()
    report = Path(args.json).with_suffix(".md")
    if args.report_only:
        report.write_text(markdown(json.loads(Path(args.json).read_text())))
        return
    torch.set_num_threads(args.threads)
    bench = get_benchmark("scienceqa")
    model = precache.load_model(None, compile=False)
    folders = adapter_set(bench.adapters(args.adapters), ROLES)
    adapters = {r: load_adapter(f, model.config, r) for r, f in folders.items()}
    engines = {m: precache.Engine(model, adapters=adapters, method=m, prefix_caching=False) for m in METHODS}
    tok = engines["nonshared"].tokenizer
    questions = {q.id: q for q in bench.load_questions("dev")}
    results = {"adapters": args.adapters, "methods": list(METHODS), "questions": {}}
    for qid in args.ids.split(","):
        turns, free = free_runs(engines, questions[qid], bench, tok)
        forced, logits_of = forced_records(engines, turns, tok)
        gold = gold_turns(tok, gold_trajectory(questions[qid], random.Random(SEED), negative=True))
        gold_forced, gold_logits = forced_records(engines, gold, tok)
        results["questions"][qid] = {
            "free": free,
            "forced": forced,
            "oracle": oracle_records(model, adapters, turns, logits_of),
            "gold_negative": {
                "turns": [t.agent for t in gold],
                "forced": gold_forced,
                "oracle": oracle_records(model, adapters, gold, gold_logits),
            },
        }
        print(qid, {m: f["stop_reason"] for m, f in free.items()}, flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    report.write_text(markdown(results))


if __name__ == "__main__":
    main()
