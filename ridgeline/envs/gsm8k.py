"""GSM8K: reward 1.0 when the number after the last "####" equals the ground truth.

Strict format on purpose: the prompt asks for the answer after "####", so
the reward also teaches the output format, and a correct number buried in
prose earns nothing (see ``extract_hash_answer``).
"""

from __future__ import annotations

from .answer_match import AnswerMatchEnv
from .registry import register
from .rewards import extract_hash_answer

__all__ = ["GSM8KEnv"]


@register("gsm8k")
class GSM8KEnv(AnswerMatchEnv):
    """Single-turn GSM8K env; ground truth from ``reward_spec.ground_truth``."""

    name = "gsm8k"

    def parse(self, action: str) -> str | None:
        return extract_hash_answer(action)
