"""The shared trajectory text: one stream that every agent continues, with no per-agent prompt.

Protocol, piece by piece (each piece is tokenized on its own with ``add_special_tokens=False``
and appended, or generated, so token boundaries are the same at training and inference)::

    env      INSTRUCTION + "\\nQuestion: <question>\\n"
    plan     "Thought: <text>\\nAction: <Type>["          stop "["
    action   "<argument>]"                                stop "]"
    env      "\\nObservation: <text>\\n"                  after Retrieve / Lookup / a bad action
    ...
    env      "\\n"                                        after Finish[answer]
    reflect  "Reflect[right]" or "Reflect[wrong]"          stop "]"
    env      "\\n"                                        after Reflect[wrong]: plan goes again

A generated piece may run one token past its stop string (a token such as ``"[\\""``); the
parsers below read only up to the stop string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROLES = ("plan", "action", "reflect")
STOP_STRINGS: dict[str, list[str]] = {"plan": ["["], "action": ["]"], "reflect": ["]"]}

INSTRUCTION = (
    "Answer the question with interleaving Thought, Action and Observation steps. "
    "Action is one of: Retrieve[entity] shows the paragraph about the entity; "
    "Lookup[keyword] shows the next sentence with the keyword in that paragraph; "
    "Finish[answer] gives the answer. "
    "After Finish, Reflect[right] or Reflect[wrong] judges the answer."
)
REFLECT_VERDICTS = ("right", "wrong")

_PLAN_RE = re.compile(r"Action:\s*(\w+)\s*\[", re.DOTALL)
_THOUGHT_RE = re.compile(r"Thought:\s*(.*?)\s*(?:\nAction:|$)", re.DOTALL)
_REFLECT_RE = re.compile(r"Reflect\s*\[\s*(right|wrong)\s*\]", re.IGNORECASE)


@dataclass(frozen=True)
class Piece:
    """A span of the trajectory and who writes it: ``"env"`` or an agent role."""

    role: str
    text: str


def header(question: str, instruction: str = INSTRUCTION) -> str:
    """The first piece: the instruction naming the tools (HotpotQA's by default), then the question."""
    return f"{instruction}\nQuestion: {question}\n"


def plan_text(thought: str, action_type: str) -> str:
    """The plan agent's piece: a thought and the action type, up to and including ``[``."""
    return f"Thought: {thought}\nAction: {action_type}["


def action_text(argument: str) -> str:
    """The action agent's piece: the argument and the closing ``]``."""
    return f"{argument}]"


def observation_text(observation: str) -> str:
    """The environment's piece after a Retrieve / Lookup (or a bad action)."""
    return f"\nObservation: {observation}\n"


FINISH_SEPARATOR = "\n"
RETRY_SEPARATOR = "\n"


def reflect_text(verdict: str) -> str:
    """The reflect agent's piece: ``Reflect[right]`` or ``Reflect[wrong]``."""
    return f"Reflect[{verdict}]"


def parse_plan(text: str) -> tuple[str, str] | None:
    """``(thought, action_type)`` from a plan piece, or None when it names no ``Action: X[``."""
    match = _PLAN_RE.search(text)
    if match is None:
        return None
    thought = _THOUGHT_RE.search(text[: match.start()] + "\nAction:")
    return (thought.group(1) if thought else "", match.group(1))


def plan_overshoot(text: str) -> str:
    """Text a plan piece generated after its ``[`` (start of the argument; usually empty)."""
    match = _PLAN_RE.search(text)
    return text[match.end() :] if match else ""


def parse_argument(text: str) -> str | None:
    """The argument from an action piece: everything before the first ``]``; None if no ``]``."""
    end = text.find("]")
    return text[:end].strip() if end >= 0 else None


def parse_reflect(text: str, strict: bool = False) -> str | None:
    """``"right"`` / ``"wrong"`` from a reflect piece.

    Strict: only ``Reflect[right]`` / ``Reflect[wrong]``. Lenient (the loop): else the first of
    the two words anywhere in the text. None when neither is found.
    """
    match = _REFLECT_RE.search(text)
    if match:
        return match.group(1).lower()
    if strict:
        return None
    found = re.search(r"\b(right|wrong)\b", text, re.IGNORECASE)
    return found.group(1).lower() if found else None
