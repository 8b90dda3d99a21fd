"""skyrl-gym 0.4.0's answer rules, reproduced exactly (the envs named like skyrl-gym's use them).

A SkyRL user compares accuracies across frameworks, so ``gsm8k`` and ``multiply`` here read and
compare answers the way skyrl-gym's ``gsm8k`` and SkyRL-Train's ``examples/multiply`` do, quirks
included (``tests/test_skyrl_gym_parity.py`` checks GSM8K against skyrl-gym itself). Ridgeline's
own, more forgiving readers are in :mod:`ridgeline.envs.rewards` (the ``*_lenient`` envs).

- GSM8K: the FIRST ``"#### "`` (one space) directly followed by a run of digits, ``.``, ``,``
  with an optional leading ``-``; commas are removed and the text is compared with the ground
  truth as a string. So ``"#### 72.0"`` is not ``"72"``, ``"####72"`` and ``"#### $72"`` are
  not answers, and ``"#### ,"`` is an answer (the empty string: a wrong one).
- multiply: the FIRST ``\\boxed{...}`` whose content has no ``}`` (``\\boxed{\\frac{1}{2}}``
  reads ``\\frac{1``); content and ground truth are compared as stripped strings.

Also here: how those envs read the row (the ground truth, the turn limit). The SQL env's rules
live with it, in :mod:`ridgeline.envs.text2sql`.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["GSM8K_ANSWER", "first_boxed", "first_hash_answer", "gsm8k_score", "skyrl_ground_truth",
           "skyrl_max_turns"]

# "#### " then an optional minus and a run of digits, dots and commas (greedy): the first match wins.
GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
# SkyRL's multiply example reads re.search(r"\\boxed\{([^}]+)\}", text): "\boxed{" then one or more
# characters up to the first "}" (no brace matching). first_boxed gives the same answer without the
# regex, which is quadratic on text with many "\boxed{" and no "}" (each start scans to the end).
_BOX_OPEN = "\\boxed{"


def first_hash_answer(text: str) -> str | None:
    """skyrl-gym's strict GSM8K reading: the number-like run after the first ``"#### "``,
    commas removed; None when no ``"#### "`` is directly followed by one."""
    match = GSM8K_ANSWER.search(text)
    return None if match is None else match.group(1).replace(",", "")


def gsm8k_score(text: str, ground_truth: str, *, format_score: float = 0.0, score: float = 1.0) -> float:
    """skyrl-gym's ``gsm8k`` reward: ``score`` when :func:`first_hash_answer` equals
    ``ground_truth`` as a string, ``format_score`` when an answer was read but differs, 0.0
    when none was read."""
    answer = first_hash_answer(text)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


def first_boxed(text: str) -> str | None:
    """The content of the first ``\\boxed{...}`` holding at least one character before its first
    ``}``, unstripped; None when there is none (SkyRL's multiply example)."""
    start = text.find(_BOX_OPEN)
    while start >= 0:
        body = start + len(_BOX_OPEN)
        end = text.find("}", body)
        if end < 0:
            return None   # no "}" after this box, so none after any later one either
        if end > body:
            return text[body:end]
        start = text.find(_BOX_OPEN, start + 1)   # "\boxed{}": empty, the regex moves on
    return None


def skyrl_ground_truth(extras: dict[str, Any], env_name: str) -> str:
    """``extras["reward_spec"]["ground_truth"]`` as skyrl-gym's ``gsm8k`` and ``text2sql`` read it:
    text (the answer string, the gold SQL).

    skyrl-gym compares the answer with it using ``==`` (or runs it as SQL), so a number such as
    ``72`` would never match and every response would score 0: that is refused here instead.
    """
    spec = extras.get("reward_spec")
    if not isinstance(spec, dict) or spec.get("ground_truth") is None:
        raise ValueError(
            f"{env_name} env needs extras['reward_spec']['ground_truth'] "
            f"(dataset column reward_spec = {{'method': 'rule', 'ground_truth': ...}}); got reward_spec={spec!r}"
        )
    truth = spec["ground_truth"]
    if not isinstance(truth, str):
        raise ValueError(
            f"{env_name} env: reward_spec.ground_truth must be a string (skyrl-gym reads it as text, so "
            f"{truth!r} of type {type(truth).__name__} would never match); write it as {str(truth)!r}"
        )
    return truth


def skyrl_max_turns(extras: dict[str, Any], max_turns: int | None, *, from_extra_info: bool = False) -> int:
    """The turn limit of a SkyRL env: the ``max_turns`` setting (the generator passes
    ``generator.max_turns``, as SkyRL's generator puts it in ``extras["max_turns"]``), else
    ``extras["max_turns"]``, else (``gsm8k_multi_turn`` only) ``extra_info.max_turns``, else 5."""
    if max_turns is not None:
        return int(max_turns)
    if "max_turns" in extras:
        return int(extras["max_turns"])
    info = extras.get("extra_info")
    if from_extra_info and isinstance(info, dict) and "max_turns" in info:
        return int(info["max_turns"])
    return 5
