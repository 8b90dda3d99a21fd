"""Multi-turn "answer, get feedback, retry" environments.

Many verifiable tasks become multi-turn by letting the model try again: the env grades each
answer; a correct one ends the episode with its reward, a wrong one gets a feedback message
(and reward 0) and another turn, and the answer on the last allowed turn ends the episode with
whatever it earned. With ``max_turns=1`` this is exactly the single-turn task.

Subclasses implement :meth:`FeedbackEnv.grade` and set ``feedback_message`` (or override
:meth:`FeedbackEnv.feedback` to say more, e.g. that no answer could be read).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from .base import Env, StepOutput

__all__ = ["FeedbackEnv", "Grade"]


@dataclass(frozen=True)
class Grade:
    """One graded answer.

    reward: what the answer earns if it ends the episode.
    correct: whether it solves the task (ends the episode early).
    parsed: what was read from the response, for metadata/logs (None: nothing readable).
    """

    reward: float
    correct: bool
    parsed: Any = None


class FeedbackEnv(Env):
    """Grade each answer; on a wrong one give feedback and let the model retry.

    Per step: ``next_turn()``; grade the response; if it is correct or this is the last turn,
    the episode ends with the grade's reward; otherwise the observation is one
    ``observation_role`` message with :meth:`feedback` and the reward is 0.

    Metrics per episode: ``attempts`` (answers given) and ``solved`` (1.0 if one was correct).
    """

    default_max_turns: ClassVar[int] = 3
    feedback_message: ClassVar[str] = "Your answer is incorrect. Please try again."
    observation_role: ClassVar[str] = "user"

    def __init__(self, extras: dict[str, Any] | None = None, **settings: Any) -> None:
        super().__init__(extras, **settings)
        self.attempts = 0
        self.solved = False

    @abstractmethod
    def grade(self, action: str) -> Grade:
        """Grade one response. Must not raise on arbitrary text."""

    def feedback(self, action: str, grade: Grade) -> str:
        """The message shown after a wrong answer. Default: ``feedback_message``."""
        return self.feedback_message

    def step_metadata(self) -> dict[str, Any]:
        """Extra metadata added to every step (e.g. the ground truth)."""
        return {}

    def step(self, action: str) -> StepOutput:
        if not isinstance(action, str):
            action = "" if action is None else str(action)
        last = self.next_turn()
        grade = self.grade(action)
        self.attempts += 1
        self.solved = self.solved or grade.correct
        metadata: dict[str, Any] = {"parsed": grade.parsed, "correct": grade.correct, "attempt": self.attempts}
        metadata.update(self.step_metadata())
        if grade.correct or last:
            return StepOutput(observations=[], reward=grade.reward, done=True, metadata=metadata)
        message = {"role": self.observation_role, "content": self.feedback(action, grade)}
        return StepOutput(observations=[message], reward=0.0, done=False, metadata=metadata)

    def get_metrics(self) -> dict[str, float]:
        return {"attempts": float(self.attempts), "solved": float(self.solved)}
