"""Answer extraction and numeric comparison for rule-based rewards.

Rewards in RL post-training are only as good as the parser that reads the
model's answer, so these helpers are deliberately small, exact and total:
they never raise on arbitrary model output (empty text, unicode junk,
100k-digit numbers) and they compare numbers as *decimal strings*, not
floats, so "1234" vs "1,234.00" is equal while huge integers never lose
precision.

Normalised form: optional "-", integer digits without leading zeros or
thousands separators, and a fractional part without trailing zeros ("42.0"
-> "42", "-0.50" -> "-0.5", "-0" -> "0"). Only ASCII digits count as digits,
so lookalike unicode digits are not silently accepted.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

__all__ = [
    "extract_hash_answer",
    "extract_last_number",
    "ground_truth_from_extras",
    "normalize_number",
    "numbers_equal",
]

# A number body: either properly grouped thousands ("1,234,567") or a plain
# run of digits, with an optional fractional part; or a bare fraction (".5").
# Grouping is strict (groups of exactly three) so that lists like "1,2,3" are
# read as three numbers rather than "123".
_NUMBER_BODY = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"

# What may follow "####" before the number: whitespace, a currency sign and a
# sign, in either order ("$-5", "-$5"), plus whitespace between them.
_HASH_ANSWER = re.compile(
    r"\s*(?:(?P<sign1>[-+])\s*)?\$?\s*(?:(?P<sign2>[-+])\s*)?(?P<body>" + _NUMBER_BODY + r")"
)

# Any number in free text. The sign is only taken when it cannot be a binary
# operator (see _sign_applies), so "5-3" ends in "3" while "is -3" ends in "-3".
_ANY_NUMBER = re.compile(r"(?P<sign>[-+])?\$?(?P<body>" + _NUMBER_BODY + r")")

# Full-string number for normalising ground truths and user-supplied values.
_FULL_NUMBER = re.compile(
    r"\s*(?P<sign1>[-+])?\s*\$?\s*(?P<sign2>[-+])?(?P<body>" + _NUMBER_BODY + r")\s*"
)

_HASH = "####"


def _normalize_parts(sign: str | None, body: str) -> str:
    """Build the canonical decimal string from a sign and a matched body."""
    body = body.replace(",", "")
    int_part, _, frac_part = body.partition(".")
    int_part = int_part.lstrip("0") or "0"
    frac_part = frac_part.rstrip("0")
    text = f"{int_part}.{frac_part}" if frac_part else int_part
    if sign == "-" and text != "0":
        text = "-" + text
    return text


def normalize_number(value: str | int | float | None) -> str | None:
    """Canonical decimal string for a number-like value, or None if it is not one.

    Strings may carry surrounding whitespace, a leading "$", thousands
    separators and a sign. Floats are converted through their shortest repr,
    so 2.5 -> "2.5" and 1e20 -> "100000000000000000000"; NaN/inf give None.
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        try:
            digits = str(abs(value))
        except ValueError:  # beyond sys.get_int_max_str_digits()
            return None
        return _normalize_parts("-" if value < 0 else None, digits)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        try:
            text = format(Decimal(repr(value)), "f")
        except (InvalidOperation, ValueError):
            return None
        return normalize_number(text)
    if not isinstance(value, str):
        return None
    match = _FULL_NUMBER.fullmatch(value)
    if match is None:
        return None
    return _normalize_parts(match.group("sign1") or match.group("sign2"), match.group("body"))


def extract_hash_answer(text: str | None) -> str | None:
    """The number right after the LAST "####" in ``text``, normalised.

    Strict on purpose: the GSM8K convention puts the final answer after
    "####", and rewarding numbers found elsewhere would let a policy be paid
    for rambling. Only whitespace, "$" and a sign may sit between "####" and
    the number. Returns None when there is no "####" or nothing numeric
    follows the last one.
    """
    if not isinstance(text, str):
        return None
    pos = text.rfind(_HASH)
    if pos < 0:
        return None
    match = _HASH_ANSWER.match(text, pos + len(_HASH))
    if match is None:
        return None
    return _normalize_parts(match.group("sign1") or match.group("sign2"), match.group("body"))


def _sign_applies(text: str, sign_pos: int) -> bool:
    """A +/- before a number is a sign only if it does not follow an operand.

    "5-3", "5 - 3" and "(2)-3" are subtractions (the number is 3); "= -3",
    "is -3" and a leading "-3" are negative numbers.
    """
    i = sign_pos - 1
    while i >= 0 and text[i].isspace():
        i -= 1
    if i < 0:
        return True
    prev = text[i]
    return not (prev in "0123456789" or prev in ")]}")


def extract_last_number(text: str | None) -> str | None:
    """The last number anywhere in ``text``, normalised; None if there is none.

    Used for direct-answer prompts ("Answer with just the number.") where the
    model may echo the question ("3 + 4 = 7"): the last number is the answer.
    """
    if not isinstance(text, str):
        return None
    last: re.Match[str] | None = None
    for last in _ANY_NUMBER.finditer(text):
        pass
    if last is None:
        return None
    sign = last.group("sign")
    if sign is not None and not _sign_applies(text, last.start("sign")):
        sign = None
    return _normalize_parts(sign, last.group("body"))


def numbers_equal(a: str | None, b: str | float | int | None) -> bool:
    """Exact numeric equality of two number-like values after normalisation.

    Comparison is on canonical decimal strings, so there is no float
    tolerance: "0.1" equals 0.1 (its shortest repr) but not 0.1000001.
    None or anything unparseable compares unequal to everything.
    """
    left = normalize_number(a)
    right = normalize_number(b)
    return left is not None and left == right


def ground_truth_from_extras(extras: dict | None, env_name: str) -> str:
    """Read and normalise ``extras["reward_spec"]["ground_truth"]`` (SkyRL schema).

    Fails at env construction, not at scoring time, because a missing or
    non-numeric ground truth would otherwise silently score every response
    0.0. A full GSM8K solution ("... #### 72") is accepted as ground truth
    and reduced to its final number.
    """
    spec = (extras or {}).get("reward_spec")
    if not isinstance(spec, dict) or spec.get("ground_truth") is None:
        raise ValueError(
            f"{env_name} env needs extras['reward_spec']['ground_truth'] "
            f"(dataset column reward_spec = {{'method': 'rule', 'ground_truth': ...}}); got reward_spec={spec!r}"
        )
    raw = spec["ground_truth"]
    normalised = normalize_number(raw)
    if normalised is None and isinstance(raw, str):
        normalised = extract_hash_answer(raw)
    if normalised is None:
        raise ValueError(f"{env_name} env: reward_spec.ground_truth {raw!r} is not a number")
    return normalised
