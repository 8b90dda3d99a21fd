"""Arithmetic: reward for the generated integer-arithmetic set.

The quickstart prompt asks for "just the number", and small models often
echo the question ("3 + 4 = 7"), so without "####" the answer is the last
number in the response. If the response uses "####" it is held to that
answer (strict), so a hash-style prompt behaves like GSM8K.
"""

from __future__ import annotations

from .answer_match import AnswerMatchEnv
from .registry import register
from .rewards import extract_hash_answer, extract_last_number

__all__ = ["ArithmeticEnv"]


@register("arithmetic")
class ArithmeticEnv(AnswerMatchEnv):
    """Single-turn arithmetic env; ground truth from ``reward_spec.ground_truth``."""

    name = "arithmetic"

    def parse(self, action: str) -> str | None:
        if "####" in action:
            return extract_hash_answer(action)
        return extract_last_number(action)
