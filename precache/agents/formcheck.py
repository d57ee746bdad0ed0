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

Uses HF transformers + PEFT directly (independent of the precache engine). Each condition
(base model, or one role's adapter, used over the whole prefix as NonShared would) makes one
pass over the gold trajectory, reusing the prefix KV cache between positions. Half of the
trajectories are negative ones (wrong answer first), so both verdicts occur.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from precache.agents import prompt
from precache.agents.data import Question, load_questions
from precache.agents.gold import gold_trajectory
from precache.agents.scoring import exact_match
from precache.agents.tools import ACTION_TYPES, normalize_title
from precache.models.loader import embedded_checkpoint
from precache.terminal import progress

logger = logging.getLogger(__name__)

MAX_NEW_TOKENS = {"plan": 40, "action": 24, "reflect": 6}


@torch.inference_mode()
def greedy_continue(model, tokenizer, new_ids: list[int], max_new_tokens: int, stop: list[str], cache=None):
    """Feed ``new_ids`` on top of ``cache`` (None: empty), then decode greedily.

    Stops when the text contains a stop string (kept, as the agent loop's pieces ``turn.text +
    turn.trimmed``), at EOS (dropped), or after ``max_new_tokens``. Returns ``(text, cache)``;
    the cache then also holds the generated tokens but the last.
    """
    inputs = torch.tensor([new_ids])  # [1, T]
    out_ids: list[int] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=inputs, cache=cache, use_cache=True)
        cache = out.cache
        token = int(out.logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        out_ids.append(token)
        if any(s in tokenizer.decode(out_ids) for s in stop):
            break
        inputs = torch.tensor([[token]])
    return tokenizer.decode(out_ids), cache


@torch.inference_mode()
def teacher_forced_continuations(model, tokenizer, pieces: list[prompt.Piece], roles) -> dict[int, str]:
    """Greedy continuation before every piece whose role is in ``roles``: ``{piece index: text}``.

    One pass over the gold trajectory: the KV cache of the gold prefix is kept and, after each
    continuation, cut back to the prefix, so the trajectory is prefilled once, not once per
    position. Pieces are tokenized separately, as the loop appends them.
    """
    cache, length, pending = None, 0, []
    texts: dict[int, str] = {}
    for index, piece in enumerate(pieces):
        if piece.role in roles:
            texts[index], cache = greedy_continue(
                model, tokenizer, pending, MAX_NEW_TOKENS[piece.role], prompt.STOP_STRINGS[piece.role], cache
            )
            length += len(pending)
            pending = []
            cache.crop(length - cache.get_seq_length())  # drop the generated tokens
        pending += tokenizer(piece.text, add_special_tokens=False).input_ids
    return texts


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


def _load(adapter_sets: dict[str, Path]):
    """Base model with every role adapter of every set, named ``<set>_<role>``."""
    from peft import PeftModel  # heavy: loaded only when a form check runs

    base_path = embedded_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    for set_name, folder in adapter_sets.items():
        for role in prompt.ROLES:
            name = f"{set_name}_{role}"
            if isinstance(model, PeftModel):
                model.load_adapter(Path(folder) / role, adapter_name=name)
            else:
                model = PeftModel.from_pretrained(model, Path(folder) / role, adapter_name=name)
    return model.eval(), tokenizer


def run_formcheck(adapter_sets: dict[str, str | Path], limit: int = 20, seed: int = 0) -> dict:
    """Form rates per role, with and without the adapter, on the first ``limit`` dev questions.

    ``adapter_sets`` maps a set name to its folder (``<folder>/<role>/`` PEFT adapters). Returns
    ``{set: {role: {"adapter": {metric: rate}, "base": {...}, "n": positions}, "examples": ...,
    "questions": n}}``, rates in [0, 1]; the base rows are shared by all sets.
    """
    model, tokenizer = _load({name: Path(folder) for name, folder in adapter_sets.items()})
    conditions = ["base", *adapter_sets]
    rng = random.Random(seed)
    questions = load_questions("dev")[:limit]
    records = {c: {r: [] for r in prompt.ROLES} for c in conditions}
    examples = {c: {r: [] for r in prompt.ROLES} for c in conditions}
    with progress(len(questions), "formcheck") as advance:
        for qi, question in enumerate(questions):
            pieces = gold_trajectory(question, rng, negative=qi % 2 == 1)
            with model.disable_adapter():
                texts = {"base": teacher_forced_continuations(model, tokenizer, pieces, prompt.ROLES)}
            for name in adapter_sets:
                texts[name] = {}
                for role in prompt.ROLES:
                    model.set_adapter(f"{name}_{role}")
                    texts[name].update(teacher_forced_continuations(model, tokenizer, pieces, (role,)))
            for condition in conditions:
                for index, text in sorted(texts[condition].items()):
                    role = pieces[index].role
                    records[condition][role].append(
                        _judge(role, text, pieces[index], pieces[index - 1], question)
                    )
                    if len(examples[condition][role]) < 3:
                        examples[condition][role].append(text)
            advance()
    return {
        name: {
            **{r: _rates({"base": records["base"][r], "adapter": records[name][r]}) for r in prompt.ROLES},
            "examples": {
                r: {"base": examples["base"][r], "adapter": examples[name][r]} for r in prompt.ROLES
            },
            "questions": len(questions),
        }
        for name in adapter_sets
    }


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


_DOCUMENT_HEADER = """# Form check of the SmolLM2-135M adapters

Generated by `precache adapters check --set qv all --limit 20` (`precache.agents.formcheck`).
Each dev question's gold trajectory is cut before every agent piece; the base model (adapters
off) and the role's adapter (over the whole prefix) continue it greedily. Metrics:

- plan `form`: output contains `Action: <Retrieve|Lookup|Finish>[`; `type_match`: that type
  is the gold step's.
- action `retrieve_title`: after `Retrieve[`, a closed argument equal to one of the question's
  paragraph titles (normalised); `finish_closed`: after `Finish[`, a closed non-empty argument;
  `finish_answer_em`: that argument matches the gold answer (EM); `form` pools both positions.
- reflect `form`: exactly `Reflect[right]` or `Reflect[wrong]`; `verdict_acc`: equals the gold
  verdict. Half the trajectories are negative (wrong answer first), so 20 of the 30 reflect
  positions are `right`: always answering `right` scores 0.67.
"""


def formcheck_markdown(root: str | Path) -> str:
    """The FORMCHECK.md document from every ``<root>/<set>/FORMCHECK.json``."""
    sections = [
        format_markdown(path.parent.name, json.loads(path.read_text(encoding="utf-8")))
        for path in sorted(Path(root).glob("*/FORMCHECK.json"))
    ]
    return _DOCUMENT_HEADER + "\n" + "\n".join(sections)
