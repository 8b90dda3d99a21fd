"""GSM8K: skyrl-gym's ``gsm8k`` and ``gsm8k_multi_turn`` exactly, and Ridgeline's lenient pair.

``gsm8k`` / ``gsm8k_multi_turn`` score every response as skyrl-gym 0.4.0 does
(:mod:`ridgeline.envs.skyrl_rules`): the first ``"#### <number>"``, commas removed, compared with
``reward_spec.ground_truth`` as a string.

- ``gsm8k``: one turn; 1.0 on a match, else 0.0.
- ``gsm8k_multi_turn``: every turn is scored: 1.0 on a match (which ends the episode),
  ``0.2 / max_turns`` for a readable wrong answer, 0.0 for none; after a miss the env asks for
  reasoning and a ``'#### ANSWER'`` again (for the answer alone before the last turn), up to
  ``max_turns`` turns (the ``max_turns`` setting, which the generator sets to
  ``generator.max_turns`` as SkyRL does; without it ``extras["max_turns"]``, then
  ``extra_info.max_turns``, then 5).

``gsm8k_lenient`` / ``gsm8k_multi_turn_lenient`` are Ridgeline's forgiving readers, for models
that write ``"####72"``, ``"#### $72"`` or ``"#### 72.0"`` or change their mind:

- ``mode: strict`` (default): the number after the LAST ``"####"``, compared as a number
  (:func:`~ridgeline.envs.rewards.extract_hash_answer`); ``mode: flexible``: the last number
  anywhere in the response (veRL's flexible mode), for prompts that do not use ``"####"``.
- ``format_score`` (0.0) for a readable wrong number, ``correct_score`` (1.0) for a right one.
- ``gsm8k_multi_turn_lenient``: a wrong or unreadable answer gets "Your answer is incorrect..."
  and another turn, up to ``max_turns`` (default 3); the answer that ends the episode gets the
  single-turn reward, earlier ones 0.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .answer_match import AnswerMatchEnv
from .base import Env, SingleTurnEnv, StepOutput
from .feedback import FeedbackEnv, Grade
from .registry import register
from .rewards import extract_hash_answer, extract_last_number
from .skyrl_rules import first_hash_answer, gsm8k_score, skyrl_ground_truth, skyrl_max_turns

__all__ = [
    "GSM8KEnv",
    "GSM8KMultiTurnEnv",
    "GSM8KLenientEnv",
    "GSM8KMultiTurnLenientEnv",
    "GSM8K_MODES",
]

GSM8K_MODES = ("strict", "flexible")


# --------------------------------------------------------------------------- skyrl-gym's envs


@register("gsm8k")
class GSM8KEnv(SingleTurnEnv):
    """skyrl-gym's single-turn GSM8K: 1.0 when the first ``"#### <number>"`` equals the ground
    truth string, else 0.0. Takes no settings (skyrl-gym's ignores ``env_config``)."""

    accepted_settings = ()

    def __init__(self, extras: dict[str, Any] | None = None, **settings: Any) -> None:
        super().__init__(extras, **settings)
        self.ground_truth = skyrl_ground_truth(self.extras, "gsm8k")

    def parse(self, action: str) -> str | None:
        return first_hash_answer(action)

    def score(self, action: str) -> float:
        return gsm8k_score(action, self.ground_truth)

    def step_metadata(self) -> dict[str, Any]:
        return {"ground_truth": self.ground_truth}


@register("gsm8k_multi_turn")
class GSM8KMultiTurnEnv(Env):
    """skyrl-gym's ``gsm8k_multi_turn``: a reward every turn (see the module docstring).

    Metrics per episode: ``steps`` (turns taken), combined per step as skyrl-gym's class does:
    ``avg_steps``, the mean (logged as ``environment/avg_steps``).
    """

    accepted_settings = ()
    format_score: ClassVar[float] = 0.2  # shared out over the turns
    retry_message: ClassVar[str] = (
        "Please provide your step-by-step reasoning, "
        "and also include a tentative numeric answer at the end in the exact format: '#### ANSWER'."
    )
    final_message: ClassVar[str] = "Now provide only the final numeric answer in the exact format: '#### ANSWER'."

    def __init__(self, extras: dict[str, Any] | None = None, *, max_turns: int | None = None,
                 **settings: Any) -> None:
        extras = dict(extras or {})
        super().__init__(extras, max_turns=skyrl_max_turns(extras, max_turns, from_extra_info=True), **settings)
        self.ground_truth = skyrl_ground_truth(self.extras, "gsm8k_multi_turn")
        self.format_score_per_turn = self.format_score / self.max_turns

    def step(self, action: str) -> StepOutput:
        last = self.next_turn()
        reward = gsm8k_score(action, self.ground_truth, format_score=self.format_score_per_turn)
        done = last or reward == 1.0
        metadata = {"parsed": first_hash_answer(action), "ground_truth": self.ground_truth}
        if done:
            return StepOutput(observations=[], reward=reward, done=True, metadata=metadata)
        message = self.retry_message if self.max_turns - self.turns > 1 else self.final_message
        return StepOutput(observations=[{"role": "user", "content": message}], reward=reward, done=False,
                          metadata=metadata)

    def get_metrics(self) -> dict[str, float]:
        return {"steps": float(self.turns)}

    def aggregate_metrics(self, episodes: list[dict[str, Any]]) -> dict[str, float]:
        return {"avg_steps": sum(float(m.get("steps", 0)) for m in episodes) / len(episodes)} if episodes else {}


# --------------------------------------------------------------------------- Ridgeline's lenient envs


@register("gsm8k_lenient")
class GSM8KLenientEnv(AnswerMatchEnv):
    """Ridgeline's single-turn GSM8K: the last ``"####"`` number (or, ``mode: flexible``, the last
    number), compared as a number; ground truth from ``reward_spec.ground_truth``."""

    name = "gsm8k_lenient"
    accepted_settings = AnswerMatchEnv.accepted_settings + ("mode",)

    def __init__(self, extras: dict[str, Any] | None = None, *, mode: str = "strict", **settings: Any) -> None:
        if mode not in GSM8K_MODES:
            raise ValueError(f"gsm8k_lenient: mode must be one of {', '.join(GSM8K_MODES)}, got {mode!r}")
        super().__init__(extras, **settings)
        self.mode = mode

    def parse(self, action: str) -> str | None:
        if self.mode == "flexible":
            return extract_last_number(action)
        return extract_hash_answer(action)


@register("gsm8k_multi_turn_lenient")
class GSM8KMultiTurnLenientEnv(FeedbackEnv):
    """``gsm8k_lenient`` with feedback: a wrong answer gets a "try again" message instead of ending
    the episode.

    Reward is that of ``gsm8k_lenient`` (same settings: ``mode``, ``format_score``,
    ``correct_score``) for the answer that ends the episode: the first correct one, or the one
    given on the last turn. Earlier wrong answers get 0.
    """

    accepted_settings = GSM8KLenientEnv.accepted_settings
    default_max_turns = 3
    feedback_message: ClassVar[str] = (
        "Your answer is incorrect. Please try again, and give the final answer after ####."
    )

    def __init__(self, extras: dict[str, Any] | None = None, **settings: Any) -> None:
        super().__init__(extras, **settings)
        # The single-turn env does the reading and scoring, so both envs reward alike.
        self.single = GSM8KLenientEnv(self.extras, **self.settings)

    def grade(self, action: str) -> Grade:
        parsed = self.single.parse(action)
        return Grade(
            reward=self.single.score(action),
            correct=parsed is not None and parsed == self.single.ground_truth,
            parsed=parsed,
        )

    def step_metadata(self) -> dict[str, Any]:
        return self.single.step_metadata()
