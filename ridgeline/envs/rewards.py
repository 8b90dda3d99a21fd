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

For answers that are not plain numbers (fractions, LaTeX), :func:`answers_equal` falls back to
math-verify, behind input screening so that it too never raises or runs long;
:func:`extract_boxed` reads ``\\boxed{...}`` answers.

Every reader runs in time linear in the text (tests/test_env_hardening.py feeds each a megabyte
of adversarial input). That is a requirement, not a nicety: a regular expression holds the GIL
while it backtracks, so a quadratic one on model text would stall every thread of the trainer and
no time limit could stop it. Hence no pattern here has two ``\\s*`` (or other unbounded runs of
the same characters) that can split one run of text between them.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from decimal import Decimal, InvalidOperation

__all__ = [
    "answers_equal",
    "extract_boxed",
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
# sign, in either order ("$-5", "-$5"), plus whitespace between them. Each run of whitespace is
# matched by one \s*+ only (two adjacent ones would try every split of a long run: quadratic), and
# possessively: what follows a run is never whitespace, so giving some back cannot help a match.
_HASH_ANSWER = re.compile(
    r"\s*+(?:(?P<sign1>[-+])\s*+)?(?:\$\s*+)?(?:(?P<sign2>[-+])\s*+)?(?P<body>" + _NUMBER_BODY + r")"
)

# Any number in free text. The sign is only taken when it cannot be a binary
# operator (see _sign_applies), so "5-3" ends in "3" while "is -3" ends in "-3".
_ANY_NUMBER = re.compile(r"(?P<sign>[-+])?\$?(?P<body>" + _NUMBER_BODY + r")")

# Full-string number for normalising ground truths and user-supplied values, matched against the
# stripped text (outer whitespace is str.strip()'s job: a leading \s* next to the one after the
# optional sign would make the match quadratic in the length of a run of spaces); possessive runs
# as in _HASH_ANSWER.
_FULL_NUMBER = re.compile(r"(?P<sign1>[-+])?\s*+(?:\$\s*+)?(?P<sign2>[-+])?(?P<body>" + _NUMBER_BODY + r")")

_HASH = "####"

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")

logger = logging.getLogger(__name__)


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
    match = _FULL_NUMBER.fullmatch(value.strip())
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


def extract_boxed(text: str | None) -> str | None:
    """The content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, stripped.

    Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. Returns None when
    there is no box, the last box is never closed, or it is empty: an empty box is not an answer.
    """
    if not isinstance(text, str):
        return None
    last: re.Match[str] | None = None
    for last in _BOXED.finditer(text):
        pass
    if last is None:
        return None
    end = _closing_brace(text, last.end())
    if end is None:
        return None
    return text[last.end():end].strip() or None


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the "}" closing a "{" that ends just before ``start``; None if unclosed."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


# --- math-verify fallback ---------------------------------------------------------------------
#
# sympy can take unbounded time on short inputs (9^{9^{9}}, \binom{10^9}{5}, deep nesting), and
# math-verify's own timeout is signal.alarm based, which only works in the main thread. So the
# inputs are screened first, the same way in every thread (a reward must not depend on which
# thread computed it), and the signal timeout is only an extra safety net where it is available.

_MATH_VERIFY_MAX_CHARS = 200
_MATH_VERIFY_MAX_DEPTH = 8
_MATH_VERIFY_TIMEOUT_S = 1  # math-verify takes whole seconds; 1 is the smallest that is on
# Operators whose value can explode: factorials, sums/products/integrals/limits, binomials, "**".
_RISKY = re.compile(r"!|\*\*|\\(?:[dt]?binom|choose|sum|prod|int|lim)|\\uparrow")
# A power is allowed only with a literal exponent of at most two digits that is not itself raised.
_POWER = re.compile(r"\^\s*(?:\{\s*[-+]?\d{1,2}\s*\}|[-+]?\d{1,2})(?!\s*\^)(?![0-9])")


def _safe_for_math_verify(text: str) -> bool:
    if len(text) > _MATH_VERIFY_MAX_CHARS or _RISKY.search(text):
        return False
    if text.count("^") > 2 or text.count("^") != len(_POWER.findall(text)):
        return False
    depth = 0
    for ch in text:
        if ch in "({[":
            depth += 1
            if depth > _MATH_VERIFY_MAX_DEPTH:
                return False
        elif ch in ")}]":
            depth -= 1
    return True


def _unwrap(text: str) -> str:
    """``\\boxed{12}`` / ``$12$`` -> ``12``, so plain numbers in light markup stay on the exact path."""
    text = text.strip()
    box = _BOXED.match(text)
    if box is not None and _closing_brace(text, box.end()) == len(text) - 1:
        text = text[box.end():-1].strip()
    if len(text) >= 2 and text[0] == text[-1] == "$":
        text = text.strip("$").strip()
    return text


def _math_verify_equal(pred: str, gold: str) -> bool:
    try:
        import math_verify
        from math_verify.errors import TimeoutException
    except ImportError:  # a dependency, but keep scoring alive without it
        return False
    # signal.alarm only works in the main thread; elsewhere rely on the input screening alone.
    timeout = _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = math_verify.parse(gold, parsing_timeout=timeout)
        pred_parsed = math_verify.parse(pred, parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except (Exception, TimeoutException) as exc:  # TimeoutException is a BaseException
        logger.debug("math-verify failed on pred=%r gold=%r: %s", pred[:80], gold[:80], exc)
        return False


def answers_equal(pred: str | None, gold: str | int | float | None) -> bool:
    """Whether a predicted answer equals the gold answer, for numeric and simple math answers.

    Plain numbers are compared exactly (:func:`numbers_equal`: decimal strings, no float
    tolerance), also inside ``\\boxed{}`` or ``$...$``. Anything else (``3/4`` vs ``0.75``,
    ``\\frac{1}{2}``, ``\\boxed{\\frac{3}{4}}``) goes to math-verify, which compares symbolically and
    numerically (to about 6 significant digits). Never raises and never runs long: inputs over
    200 characters, nested deeper than 8 brackets, or with factorials, sums, big or stacked powers
    are not handed to math-verify and compare unequal.

    Note that math-verify evaluates expressions, so ``12 * 34`` equals ``408``: do not use this for
    tasks where doing the computation is the skill being rewarded (see the multiply env).
    """
    if not isinstance(pred, str) or isinstance(gold, bool) or gold is None:
        return False
    gold_text = gold if isinstance(gold, str) else normalize_number(gold)
    if gold_text is None:
        return False
    left, right = normalize_number(_unwrap(pred)), normalize_number(_unwrap(gold_text))
    if left is not None and right is not None:
        return left == right
    if not (_safe_for_math_verify(pred) and _safe_for_math_verify(gold_text)):
        return False
    return _math_verify_equal(pred, gold_text)
