"""Offline ScienceQA tools (``Image``, ``Lookup``, ``Finish``), the header and the gold trajectory.

AutoAct's ScienceQA agents had an image-to-text tool, a web search and a background retriever.
Offline, ``Image[...]`` shows the question's caption and OCR text (the AutoAct data's own image
text), ``Lookup[keyword]`` shows the option or question line that holds a keyword, and
``Finish[letter]`` ends with an option (:func:`~precache.agents.scienceqa.parse_option`). Like
:class:`~precache.agents.tools.ToolEnv`, a bad action never raises: it yields an error
observation. The trajectory protocol is HotpotQA's (:mod:`precache.agents.prompt`).
"""

from __future__ import annotations

import random

from precache.agents import prompt
from precache.agents.gold import gold_ending
from precache.agents.scienceqa import ScienceQuestion, parse_option
from precache.agents.tools import StepResult, parse_action

ACTION_TYPES = ("Image", "Lookup", "Finish")
INSTRUCTION = (
    "Answer the multiple-choice question with interleaving Thought, Action and Observation steps. "
    "Action is one of: Image[image] shows the caption of the question's image and the text in it; "
    "Lookup[keyword] shows the question or option line with the keyword; "
    "Finish[letter] gives the letter of the chosen option. "
    "After Finish, Reflect[right] or Reflect[wrong] judges the answer."
)
NO_IMAGE_TEXT = "There is no image for this question."
NO_OCR_TEXT = "No text in the image."

_FIRST_THOUGHTS = ("I should look at the image first.", "Let me check the image.")
_FINISH_THOUGHTS = ("The answer is {text}.", "The correct option is {text}.")


def header(question: ScienceQuestion) -> str:
    """The first piece: the instruction naming the tools, then the question with its options."""
    return prompt.header(question.question, INSTRUCTION)


def image_observation(question: ScienceQuestion) -> str:
    """``"<caption> Text in the image: <ocr>"`` (``No text in the image.`` when the OCR found none),
    or ``NO_IMAGE_TEXT`` for a question without an image."""
    if not question.has_image:
        return NO_IMAGE_TEXT
    text = f"Text in the image: {question.ocr}" if question.ocr else NO_OCR_TEXT
    return f"{question.caption} {text}"


class ScienceQAEnv:
    """The tools over one question; ``step("Image[image]")`` returns a :class:`StepResult`.

    ``Image``'s argument names what to look at; a question has one image, so any argument shows it.
    """

    def __init__(self, question: ScienceQuestion) -> None:
        self.question = question
        stem, _ = question.question.split("\nOptions: ", 1)
        self._lines = [line.strip() for line in stem.splitlines() if line.strip()]
        self._lines += [
            f"({letter}) {choice}" for letter, choice in zip(question.letters, question.choices, strict=True)
        ]

    def step(self, action: str) -> StepResult:
        """Run one action written as ``Type[argument]``."""
        parsed = parse_action(action)
        usage = "Write Image[image], Lookup[keyword] or Finish[letter]."
        if parsed is None:
            return StepResult(f"Invalid action {action.strip()!r}. {usage}", error=True)
        kind, argument = parsed
        if kind not in ACTION_TYPES:
            return StepResult(f"Unknown action {kind}. {usage}", error=True)
        if not argument:
            return StepResult(f"{kind} needs an argument inside the brackets.", error=True)
        if kind == "Image":
            return StepResult(image_observation(self.question))
        if kind == "Lookup":
            return self.lookup(argument)
        letter = parse_option(argument, self.question)
        if letter is None:
            return StepResult(
                f"{argument} is not an option. Finish with one of the letters {', '.join(self.question.letters)}.",
                error=True,
            )
        return StepResult(f"Finished with answer: {letter}", done=True, answer=argument)

    def lookup(self, keyword: str) -> StepResult:
        """The question and option lines that contain ``keyword`` (case-insensitive), joined by spaces."""
        hits = [line for line in self._lines if keyword.lower() in line.lower()]
        if not hits:
            return StepResult(f"No line of the question or options contains {keyword}.")
        return StepResult(" ".join(hits))


def wrong_option(question: ScienceQuestion, rng: random.Random) -> str:
    """A letter of the question's options other than the gold one."""
    return rng.choice([letter for letter in question.letters if letter != question.answer])


def gold_trajectory(
    question: ScienceQuestion, rng: random.Random, negative: bool = False
) -> list[prompt.Piece]:
    """One gold trajectory: ``Image[image]`` (its observation from :class:`ScienceQAEnv`), then
    ``Finish[<gold letter>]`` and ``Reflect[right]``; a negative one first finishes with another
    letter and reflects ``wrong``, then retries with the gold letter."""
    observation = ScienceQAEnv(question).step("Image[image]").observation
    pieces = [
        prompt.Piece("env", header(question)),
        prompt.Piece("plan", prompt.plan_text(rng.choice(_FIRST_THOUGHTS), "Image")),
        prompt.Piece("action", prompt.action_text("image")),
        prompt.Piece("env", prompt.observation_text(observation)),
    ]
    wrong = wrong_option(question, rng) if negative else None
    text = question.answer_text if wrong is None else question.choices[question.letters.index(wrong)]
    thought = rng.choice(_FINISH_THOUGHTS).format(text=text)
    return pieces + gold_ending(question.answer, thought, wrong)
