"""Specialisation report: does each role's adapter make its output take the right form?

On dev questions, each gold trajectory is cut before every agent piece (teacher forcing) and
the model greedily continues the prefix, once with that role's adapter and once with the
adapters disabled (the base model). Forms checked (strict):

- plan: ``Thought: ...\\nAction: <Type>[`` with Type in Retrieve / Lookup / Finish;
  ``type_match`` is the share whose Type equals the gold step's.
- action after ``Retrieve[``: a closed argument that names one of the question's paragraph
  titles (same title after normalisation), ``retrieve_title``; after ``Finish[``: a closed
  non-empty argument, ``finish_closed``, and ``finish_answer_em`` its exact match with the gold
  answer. ``form`` pools both kinds of position.
- reflect: ``Reflect[right]`` or ``Reflect[wrong]``; ``verdict_acc`` against the gold verdict.

Uses HF transformers + PEFT directly (independent of the precache engine). Half of the
trajectories are negative ones (wrong answer first), so both verdicts occur.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from tqdm import tqdm

from precache.agents import prompt
from precache.agents.data import Question, load_questions
from precache.agents.gold import gold_trajectory
from precache.agents.scoring import exact_match
from precache.agents.tools import ACTION_TYPES, normalize_title

logger = logging.getLogger(__name__)

MAX_NEW_TOKENS = {"plan": 48, "action": 32, "reflect": 8}


@torch.inference_mode()
def greedy_continue(model, tokenizer, prefix_ids: list[int], max_new_tokens: int, stop: list[str]) -> str:
    """Greedy decode after ``prefix_ids`` until a stop string is complete, EOS, or the limit.

    Returns the decoded new text (stop string included, as the engine's ``turn.text``).
    """
    cache = None
    inputs = torch.tensor([prefix_ids])
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=inputs, cache=cache, use_cache=True)
        cache = out.cache
        next_id = int(out.logits[0, -1].argmax())
        if next_id == tokenizer.eos_token_id:
            break
        new_ids.append(next_id)
        if any(s in tokenizer.decode(new_ids) for s in stop):
            break
        inputs = torch.tensor([[next_id]])
    return tokenizer.decode(new_ids)


def _judge(role: str, text: str, gold: prompt.Piece, previous: prompt.Piece, question: Question) -> dict:
    """Form checks of one generated piece against the gold piece it replaces."""
    if role == "plan":
        parsed = prompt.parse_plan(text)
        ok = parsed is not None and parsed[1] in ACTION_TYPES
        return {"form": ok, "type_match": ok and parsed[1] == prompt.parse_plan(gold.text)[1]}
    if role == "action":
        argument = prompt.parse_argument(text)
        if previous.text.endswith("Finish["):
            ok = bool(argument)
            em = ok and exact_match(argument, question.answer) == 1.0
            return {"form": ok, "finish_closed": ok, "finish_answer_em": em}
        titles = {normalize_title(t) for t in question.titles}
        ok = bool(argument) and normalize_title(argument) in titles
        return {"form": ok, "retrieve_title": ok}
    verdict = prompt.parse_reflect(text, strict=True)
    return {"form": verdict is not None, "verdict_acc": verdict == prompt.parse_reflect(gold.text)}


def _positions(tokenizer, pieces: list[prompt.Piece]):
    """Yield ``(index, prefix_ids)`` for every agent piece of a trajectory."""
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        if piece.role in prompt.ROLES:
            yield index, list(ids)
        ids += tokenizer(piece.text, add_special_tokens=False).input_ids


def run_formcheck(adapter_dir: str | Path, limit: int = 20, seed: int = 0) -> dict:
    """Form rates per role, with and without the adapter, on the first ``limit`` dev questions.

    Returns ``{role: {"adapter": {metric: rate}, "base": {...}, "n": positions}}``, rates in
    [0, 1], plus ``"examples"``: a few generated texts per role and condition.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from precache.models.loader import embedded_checkpoint

    base_path = embedded_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    adapter_dir = Path(adapter_dir)
    model = PeftModel.from_pretrained(base, adapter_dir / "plan", adapter_name="plan")
    for role in ("action", "reflect"):
        model.load_adapter(adapter_dir / role, adapter_name=role)
    model.eval()
    rng = random.Random(seed)
    questions = load_questions("dev")[:limit]
    records: dict[str, dict[str, list[dict]]] = {r: {"adapter": [], "base": []} for r in prompt.ROLES}
    examples: dict[str, dict[str, list[str]]] = {r: {"adapter": [], "base": []} for r in prompt.ROLES}
    for qi, question in enumerate(tqdm(questions, desc=f"formcheck {adapter_dir.name}")):
        pieces = gold_trajectory(question, rng, negative=qi % 2 == 1)
        for index, prefix in _positions(tokenizer, pieces):
            role = pieces[index].role
            for condition in ("adapter", "base"):
                text = _generate(model, tokenizer, prefix, role, use_adapter=condition == "adapter")
                records[role][condition].append(
                    _judge(role, text, pieces[index], pieces[index - 1], question)
                )
                if len(examples[role][condition]) < 3:
                    examples[role][condition].append(text)
    report = {role: _rates(records[role]) for role in prompt.ROLES}
    report["examples"] = examples
    report["questions"] = len(questions)
    return report


def _generate(model, tokenizer, prefix: list[int], role: str, use_adapter: bool) -> str:
    stop = prompt.STOP_STRINGS[role]
    if use_adapter:
        model.set_adapter(role)
        return greedy_continue(model, tokenizer, prefix, MAX_NEW_TOKENS[role], stop)
    with model.disable_adapter():
        return greedy_continue(model, tokenizer, prefix, MAX_NEW_TOKENS[role], stop)


def _rates(by_condition: dict[str, list[dict]]) -> dict:
    result: dict = {"n": len(by_condition["adapter"])}
    for condition, rows in by_condition.items():
        metrics = sorted({key for row in rows for key in row})
        result[condition] = {
            key: sum(row[key] for row in rows if key in row) / max(1, sum(key in row for row in rows))
            for key in metrics
        }
    return result


def format_markdown(name: str, report: dict) -> str:
    """A markdown section (table: role, metric, base rate, adapter rate) for one adapter set."""
    lines = [
        f"## Set `{name}` ({report['questions']} dev questions, greedy, teacher-forced prefixes)",
        "",
        "| role | positions | metric | base model | with adapter |",
        "|---|---|---|---|---|",
    ]
    for role in prompt.ROLES:
        row = report[role]
        for metric in row["adapter"]:
            lines.append(
                f"| {role} | {row['n']} | {metric} | {row['base'][metric]:.2f} | {row['adapter'][metric]:.2f} |"
            )
    lines += ["", "Sample outputs (first three positions):", ""]
    for role in prompt.ROLES:
        for condition in ("base", "adapter"):
            shown = " / ".join(repr(t) for t in report["examples"][role][condition])
            lines.append(f"- {role}, {condition}: {shown}")
    return "\n".join(lines) + "\n"
