"""Shared base of the numeric-answer envs (gsm8k_lenient, arithmetic): parse a number, compare it
with `reward_spec.ground_truth`.

Reward: `correct_score` (1.0) on a match; `format_score` (default 0.0, veRL's knob) when a number
was read but is wrong; 0.0 when nothing could be read. A small format score gives a model that
cannot solve anything yet a gradient toward answering in the expected form.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .base import SingleTurnEnv
from .rewards import ground_truth_from_extras


class AnswerMatchEnv(SingleTurnEnv):
    """Subclasses set `name` and implement `parse(action) -> normalised number string | None`."""

    name = "answer_match"
    accepted_settings: ClassVar[tuple[str, ...]] = ("format_score", "correct_score")

    def __init__(self, extras: dict[str, Any] | None = None, *, format_score: float = 0.0,
                 correct_score: float = 1.0, **settings: Any) -> None:
        super().__init__(extras, **settings)
        self.format_score = float(format_score)
        self.correct_score = float(correct_score)
        self.ground_truth: str = ground_truth_from_extras(self.extras, self.name)

    def score(self, action: str) -> float:
        parsed = self.parse(action)
        if parsed is None:
            return 0.0
        return self.correct_score if parsed == self.ground_truth else self.format_score

    def step_metadata(self) -> dict[str, Any]:
        return {"ground_truth": self.ground_truth}
