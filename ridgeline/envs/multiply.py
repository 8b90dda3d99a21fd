"""Multiply (SkyRL-Train's ``examples/multiply``): put the product of two numbers in ``\\boxed{}``.

``multiply`` scores exactly as SkyRL-Train 0.3.1's example env: the FIRST ``\\boxed{...}``
(content up to its first ``}``) is the answer, compared with ``str(reward_spec.ground_truth)``
after stripping both. For the answer that ends the episode:

- 1.0: it matches;
- 0.5: there is a boxed answer, but it does not match (``"56,088"`` and ``"56088.0"`` do not);
- 0.0: no boxed answer.

A wrong answer before the last turn gets reward 0 and the message "Your answer '<answer>' is
incorrect. Please try again." (or, without a box, a request for ``\\boxed{your_answer}``); the
turn limit is the ``max_turns`` setting (the generator sets ``generator.max_turns``), else
``extras["max_turns"]``, else 5.

``multiply_lenient`` is Ridgeline's reading: the LAST non-empty ``\\boxed{...}`` with matched
braces, compared as a number ("1,234" and "1234.0" count as 1234); wrong answers get "Incorrect,
try again"; single-turn unless ``max_turns`` says otherwise. Neither uses math-verify: it would
evaluate ``\\boxed{123 \\times 456}`` and pay the model for restating the question.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .feedback import FeedbackEnv, Grade
from .registry import register
from .rewards import extract_boxed, ground_truth_from_extras, normalize_number
from .skyrl_rules import first_boxed, skyrl_max_turns

__all__ = ["MultiplyEnv", "MultiplyLenientEnv"]


@register("multiply")
class MultiplyEnv(FeedbackEnv):
    """SkyRL's multiply example env. Metrics: ``attempts`` and ``solved`` (Ridgeline's)."""

    accepted_settings = ()
    correct_reward: ClassVar[float] = 1.0
    boxed_reward: ClassVar[float] = 0.5
    missing_box_message: ClassVar[str] = "Please provide your answer in the format \\boxed{your_answer}."

    def __init__(self, extras: dict[str, Any] | None = None, *, max_turns: int | None = None,
                 **settings: Any) -> None:
        extras = dict(extras or {})
        super().__init__(extras, max_turns=skyrl_max_turns(extras, max_turns), **settings)
        spec = self.extras.get("reward_spec")
        if not isinstance(spec, dict) or spec.get("ground_truth") is None:
            raise ValueError(
                "multiply env needs extras['reward_spec']['ground_truth'] (dataset column "
                f"reward_spec = {{'method': 'rule', 'ground_truth': '56088'}}); got reward_spec={spec!r}"
            )
        # SkyRL compares with str() of whatever the row holds, so 56088 and "56088" both work.
        self.ground_truth = str(spec["ground_truth"]).strip()

    def grade(self, action: str) -> Grade:
        answer = first_boxed(action)
        if answer is None:
            return Grade(reward=0.0, correct=False, parsed=None)
        if answer.strip() == self.ground_truth:
            return Grade(reward=self.correct_reward, correct=True, parsed=answer)
        return Grade(reward=self.boxed_reward, correct=False, parsed=answer)

    def feedback(self, action: str, grade: Grade) -> str:
        if grade.parsed is None:
            return self.missing_box_message
        return f"Your answer '{grade.parsed}' is incorrect. Please try again."

    def step_metadata(self) -> dict[str, Any]:
        return {"ground_truth": self.ground_truth}


@register("multiply_lenient")
class MultiplyLenientEnv(FeedbackEnv):
    """Ridgeline's boxed-product env (see the module docstring); ground truth from
    ``reward_spec.ground_truth``, a number."""

    accepted_settings = ()
    default_max_turns = 1
    feedback_message: ClassVar[str] = "Incorrect, try again"
    missing_box_message: ClassVar[str] = "Incorrect, try again. Put your final answer in \\boxed{}."

    correct_reward: ClassVar[float] = 1.0
    boxed_reward: ClassVar[float] = 0.5

    def __init__(self, extras: dict[str, Any] | None = None, **settings: Any) -> None:
        super().__init__(extras, **settings)
        self.ground_truth: str = ground_truth_from_extras(self.extras, "multiply_lenient")

    def grade(self, action: str) -> Grade:
        boxed = extract_boxed(action)
        if boxed is None:
            return Grade(reward=0.0, correct=False, parsed=None)
        if normalize_number(boxed) == self.ground_truth:
            return Grade(reward=self.correct_reward, correct=True, parsed=boxed)
        return Grade(reward=self.boxed_reward, correct=False, parsed=boxed)

    def feedback(self, action: str, grade: Grade) -> str:
        return self.missing_box_message if grade.parsed is None else self.feedback_message

    def step_metadata(self) -> dict[str, Any]:
        return {"ground_truth": self.ground_truth}
