"""Generated multiplication problems for the ``multiply`` env (SkyRL's example task).

Each row asks for the product of two ``num_digits``-digit numbers, answered in ``\\boxed{}``:
"What is 123 * 456? Put your final answer in \\boxed{}." with ground truth "56088".

Problems are ordered pairs (a, b), sampled as distinct indices into the space of all pairs, so
train and validation never share a problem and the same seed gives identical files. Validation
is drawn first, so changing ``num_train`` does not change it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from .dataset import write_parquet
from .prepare_arithmetic import _sample_indices
from .schema import arrow_schema

__all__ = ["prepare_multiply", "MULTIPLY_PROMPT", "MAX_DIGITS"]

MULTIPLY_PROMPT = "What is {a} * {b}? Put your final answer in \\boxed{{}}."
MAX_DIGITS = 50


def _extra_info_fields() -> list[tuple[str, Any]]:
    import pyarrow as pa

    # Operands as text inside "expression": beyond 18 digits they do not fit an int64 column.
    return [("expression", pa.string()), ("split", pa.string()), ("index", pa.int64())]


def prepare_multiply(
    output_dir: str | Path,
    num_train: int = 2000,
    num_val: int = 200,
    *,
    num_digits: int = 3,
    seed: int = 0,
    env_class: str = "multiply",
) -> dict[str, Path]:
    """Write ``train.parquet`` and ``validation.parquet`` of ``num_digits``-digit products.

    ``env_class`` is the environment the rows name: ``multiply`` (SkyRL's example, exactly) or
    ``multiply_lenient`` (Ridgeline's reader).

    Returns ``{"train": path, "validation": path}``. Raises ValueError when the space of
    ``num_digits``-digit pairs cannot hold ``num_train + num_val`` distinct problems.
    """
    if num_train < 1 or num_val < 0:
        raise ValueError(f"need num_train >= 1 and num_val >= 0, got num_train={num_train}, num_val={num_val}")
    if not 1 <= num_digits <= MAX_DIGITS:
        raise ValueError(f"num_digits must be between 1 and {MAX_DIGITS}, got {num_digits}")
    low = 10 ** (num_digits - 1) if num_digits > 1 else 1  # 1-digit operands are 1..9: "0 *" is no exercise
    count = 10**num_digits - low
    space = count * count
    if num_train + num_val > space:
        raise ValueError(
            f"only {space} distinct {num_digits}-digit products exist; cannot draw num_train={num_train} "
            f"and num_val={num_val} distinct problems. Use more digits or fewer problems."
        )

    indices = _sample_indices(random.Random(seed), space, num_val + num_train)
    schema = arrow_schema(_extra_info_fields())
    written: dict[str, Path] = {}
    for split, split_indices in (("validation", indices[:num_val]), ("train", indices[num_val:])):
        rows = []
        for row_index, space_index in enumerate(split_indices):
            a, b = (low + i for i in divmod(space_index, count))
            rows.append(
                {
                    "data_source": "multiply",
                    "prompt": [{"role": "user", "content": MULTIPLY_PROMPT.format(a=a, b=b)}],
                    "env_class": env_class,
                    "reward_spec": {"method": "rule", "ground_truth": str(a * b)},
                    "extra_info": {"expression": f"{a} * {b}", "split": split, "index": row_index},
                }
            )
        written[split] = write_parquet(rows, Path(output_dir) / f"{split}.parquet", schema)
    return {"train": written["train"], "validation": written["validation"]}
