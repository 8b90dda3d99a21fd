"""Procedurally generated integer arithmetic, for quickstarts and ablations.

A dataset that any model size can make progress on, with difficulty knobs
(operand range, operations, number of operands) and no download. Every
problem is a point in a finite space (operand values x operators), so we
sample *indices* into that space: uniform, seeded, and dedupe is exact.

Validation problems are distinct, drawn first (so changing ``num_train``
never changes the validation set), and never appear in train. Train
problems are distinct while the rest of the space allows; when
``num_train`` exceeds it (the defaults: 30 x 30 = 900 sums, 200 held out),
train cycles through reshuffled passes of the remaining problems and a
warning says so. Only a space too small to hold out ``num_val`` problems
*and* leave some for training is an error.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from .dataset import write_parquet
from .schema import arrow_schema

__all__ = ["prepare_arithmetic", "PROMPT_STYLES", "ALLOWED_OPS"]

logger = logging.getLogger(__name__)

ALLOWED_OPS = "+-*"
PROMPT_STYLES = {
    "direct": "What is {expr}? Answer with just the number.",
    "hash": 'What is {expr}? Give the final answer after "####".',
}


def _extra_info_fields() -> list[tuple[str, Any]]:
    import pyarrow as pa

    return [("expression", pa.string()), ("split", pa.string()), ("index", pa.int64())]


def _decode(index: int, values: range, ops: str, num_operands: int) -> tuple[list[int], list[str]]:
    """Mixed-radix decode of a space index into (operands, operators)."""
    operands = []
    for _ in range(num_operands):
        index, digit = divmod(index, len(values))
        operands.append(values[digit])
    operators = []
    for _ in range(num_operands - 1):
        index, digit = divmod(index, len(ops))
        operators.append(ops[digit])
    return operands, operators


def _format(operands: list[int], operators: list[str]) -> str:
    parts = [str(operands[0])]
    for op, operand in zip(operators, operands[1:]):
        parts += [op, str(operand)]
    return " ".join(parts)


def _evaluate(operands: list[int], operators: list[str]) -> int:
    """Value with the usual precedence (* before + and -, otherwise left to right).

    Equal to Python's ``eval`` of the formatted expression (the tests check
    that), but without eval's recursion limit on long operand chains.
    """
    total, term, sign = 0, operands[0], 1
    for op, operand in zip(operators, operands[1:]):
        if op == "*":
            term *= operand
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), operand
    return total + sign * term


def _worked_answer(expression: str, answer: str, prompt_style: str) -> str:
    """The answer a prompt of `prompt_style` asks for, worked: the sum, then the number alone
    ("direct") or after "####" ("hash", GSM8K's format)."""
    return f"{expression} = {answer}\n#### {answer}" if prompt_style == "hash" else answer


def _sample_indices(rng: random.Random, space: int, count: int) -> list[int]:
    """``count`` distinct indices from range(space), in random order."""
    if count * 2 <= space:
        # Rejection sampling: cheap when we need at most half of the space, and
        # works for spaces far too large to list.
        seen: set[int] = set()
        chosen: list[int] = []
        while len(chosen) < count:
            candidate = rng.randrange(space)
            if candidate not in seen:
                seen.add(candidate)
                chosen.append(candidate)
        return chosen
    # Here space < 2 * count, so listing it is affordable.
    order = list(range(space))
    rng.shuffle(order)
    return order[:count]


def _validate(
    num_train: int, num_val: int, min_operand: int, max_operand: int, ops: str, num_operands: int, prompt_style: str
) -> str:
    if num_train < 1:
        raise ValueError(f"num_train must be >= 1, got {num_train}")
    if num_val < 0:
        raise ValueError(f"num_val must be >= 0, got {num_val}")
    if min_operand < 0 or max_operand < min_operand:
        raise ValueError(f"need 0 <= min_operand <= max_operand, got min_operand={min_operand}, max_operand={max_operand}")
    if num_operands < 2:
        raise ValueError(f"num_operands must be >= 2, got {num_operands}")
    if not ops or set(ops) - set(ALLOWED_OPS):
        raise ValueError(f"ops must be a non-empty combination of {ALLOWED_OPS!r} (e.g. '+', '+-', '+-*'), got {ops!r}")
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style must be one of {sorted(PROMPT_STYLES)}, got {prompt_style!r}")
    return "".join(dict.fromkeys(ops))  # dedupe, keep order


def prepare_arithmetic(
    output_dir: str | Path,
    *,
    num_train: int = 2000,
    num_val: int = 200,
    min_operand: int = 1,
    max_operand: int = 30,
    ops: str = "+",
    num_operands: int = 2,
    seed: int = 0,
    prompt_style: str = "direct",
    env_class: str = "arithmetic",
    worked_answers: bool = False,
) -> dict[str, Path]:
    """Generate and write ``train.parquet`` and ``validation.parquet``.

    Args:
        min_operand, max_operand: inclusive operand range (controls digits).
        ops: operators to draw from, any of "+", "-", "*" (e.g. "+-*").
        num_operands: operands per expression (2 = one operation).
        seed: same seed and knobs -> identical files.
        prompt_style: "direct" ("Answer with just the number.") or "hash"
            (answer after "####").
        env_class: the environment rows name (a custom env that checks the same
            ground truth, e.g. a tool-using calculator env, can reuse this data).
        worked_answers: also write a `response` column, a worked answer in the
            prompt style's format ("12 + 7 = 19", then "#### 19" for hash), so
            the same files serve `ridgeline sft` (prompt + response) and RL.

    Returns ``{"train": path, "validation": path}``.
    """
    ops = _validate(num_train, num_val, min_operand, max_operand, ops, num_operands, prompt_style)
    values = range(min_operand, max_operand + 1)
    space = len(values) ** num_operands * len(ops) ** (num_operands - 1)
    if space <= num_val:
        raise ValueError(
            f"only {space} distinct problems exist for operands {min_operand}..{max_operand}, ops {ops!r}, "
            f"{num_operands} operands; cannot hold out num_val={num_val} and still have training problems. "
            "Widen the operand range, add operations or operands, or lower num_val."
        )

    rng = random.Random(seed)
    train_space = space - num_val
    unique_train = min(num_train, train_space)
    indices = _sample_indices(rng, space, num_val + unique_train)
    val_indices, train_indices = indices[:num_val], indices[num_val:]
    if num_train > train_space:
        # Every non-validation problem is already in train_indices; repeat in fresh shuffles.
        logger.warning(
            "arithmetic: only %d problems outside validation for num_train=%d; train repeats problems "
            "(about %.1fx each). Widen max_operand/ops/num_operands for more variety.",
            train_space,
            num_train,
            num_train / train_space,
        )
        pool = list(train_indices)
        while len(train_indices) < num_train:
            rng.shuffle(pool)
            train_indices = train_indices + pool[: num_train - len(train_indices)]

    template = PROMPT_STYLES[prompt_style]
    schema = arrow_schema(_extra_info_fields())
    if worked_answers:
        import pyarrow as pa
        schema = schema.append(pa.field("response", pa.string()))
    written: dict[str, Path] = {}
    for split, split_indices in (("train", train_indices), ("validation", val_indices)):
        rows = []
        for row_index, space_index in enumerate(split_indices):
            operands, operators = _decode(space_index, values, ops, num_operands)
            expression = _format(operands, operators)
            answer = str(_evaluate(operands, operators))
            row = {
                "data_source": "arithmetic",
                "prompt": [{"role": "user", "content": template.format(expr=expression)}],
                "env_class": env_class,
                "reward_spec": {"method": "rule", "ground_truth": answer},
                "extra_info": {"expression": expression, "split": split, "index": row_index},
            }
            if worked_answers:
                row["response"] = _worked_answer(expression, answer, prompt_style)
            rows.append(row)
        written[split] = write_parquet(rows, Path(output_dir) / f"{split}.parquet", schema)
    return written
