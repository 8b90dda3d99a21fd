"""Small generated stdin/stdout programming problems for the ``code`` env (no download).

A smoke-test and quickstart dataset: each problem comes from a template (sum/product/max of two
integers, reverse a string, count vowels, n-th Fibonacci, sum of a list, palindrome check, ...),
some with a parameter (a modulus, a multiplier, a letter), and has 3-5 generated test cases. The
expected outputs are computed here in Python; every row also stores a reference ``solution``
program in ``extra_info`` (handy for tests and SFT warm-up), which the tests run in the env.

Train and validation are drawn from separate seeded streams over the same templates (validation
never depends on ``num_train``). They share templates, and may share a parameter, but their test
cases are drawn independently: this set checks that the training loop learns, it does not measure
generalisation to unseen tasks. Same seed and sizes -> identical files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dataset import write_parquet
from .schema import arrow_schema

__all__ = ["prepare_code", "TEMPLATES", "CodeTemplate"]

_INSTRUCTIONS = (
    "Write a complete Python 3 program that reads the input from standard input and prints the answer "
    "to standard output. Put the whole program in a single ```python code block."
)


@dataclass(frozen=True)
class CodeTemplate:
    """One problem family.

    ``param`` draws a parameter (or None); ``statement(param)`` is the problem text (with input and
    output format); ``make_input(rng, param)`` one test input; ``solve(input, param)`` its expected
    output; ``solution(param)`` a reference program.
    """

    name: str
    statement: Callable[[Any], str]
    make_input: Callable[[random.Random, Any], str]
    solve: Callable[[str, Any], str]
    solution: Callable[[Any], str]
    param: Callable[[random.Random], Any] = lambda rng: None


def _two_ints(rng: random.Random, _: Any) -> str:
    return f"{rng.randint(-1000, 1000)} {rng.randint(-1000, 1000)}\n"


def _word(rng: random.Random, _: Any = None, alphabet: str = "abcdefghijklmnopqrstuvwxyz") -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))


def _palindrome_input(rng: random.Random, _: Any) -> str:
    if rng.random() < 0.5:
        half = _word(rng, alphabet="abc")
        return half + (half[-2::-1] if rng.random() < 0.5 else half[::-1]) + "\n"
    return _word(rng, alphabet="abc") + "\n"


def _int_list(rng: random.Random, _: Any) -> str:
    return " ".join(str(rng.randint(-100, 100)) for _ in range(rng.randint(1, 10))) + "\n"


def _fib(n: int, mod: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % mod
    return a


def _two_int_template(name: str, what: str, expression: str, fn: Callable[[int, int], int]) -> CodeTemplate:
    return CodeTemplate(
        name=name,
        statement=lambda _: (f"Read two integers a and b from one line (separated by a space) and print {what}.\n\n"
                             "Input: one line with two integers a and b (-1000 <= a, b <= 1000).\n"
                             "Output: one integer."),
        make_input=_two_ints,
        solve=lambda text, _: str(fn(*map(int, text.split()))),
        solution=lambda _: f"a, b = map(int, input().split())\nprint({expression})\n",
    )


TEMPLATES: tuple[CodeTemplate, ...] = (
    _two_int_template("sum", "their sum", "a + b", lambda a, b: a + b),
    _two_int_template("product", "their product", "a * b", lambda a, b: a * b),
    _two_int_template("max", "the larger of the two", "max(a, b)", max),
    _two_int_template("difference", "a minus b", "a - b", lambda a, b: a - b),
    CodeTemplate(
        name="scaled_sum",
        param=lambda rng: rng.randint(2, 9),
        statement=lambda k: (f"Read two integers a and b from one line and print {k} times their sum.\n\n"
                             "Input: one line with two integers a and b (-1000 <= a, b <= 1000).\n"
                             "Output: one integer."),
        make_input=_two_ints,
        solve=lambda text, k: str(k * sum(map(int, text.split()))),
        solution=lambda k: f"a, b = map(int, input().split())\nprint({k} * (a + b))\n",
    ),
    CodeTemplate(
        name="reverse",
        statement=lambda _: ("Read a word and print it reversed.\n\n"
                             "Input: one line with a word of lowercase letters.\nOutput: the reversed word."),
        make_input=lambda rng, _: _word(rng) + "\n",
        solve=lambda text, _: text.strip()[::-1],
        solution=lambda _: "s = input().strip()\nprint(s[::-1])\n",
    ),
    CodeTemplate(
        name="count_vowels",
        statement=lambda _: ("Read a word and print how many vowels (a, e, i, o, u) it contains.\n\n"
                             "Input: one line with a word of lowercase letters.\nOutput: one integer."),
        make_input=lambda rng, _: _word(rng) + "\n",
        solve=lambda text, _: str(sum(c in "aeiou" for c in text.strip())),
        solution=lambda _: "s = input().strip()\nprint(sum(c in 'aeiou' for c in s))\n",
    ),
    CodeTemplate(
        name="count_letter",
        param=lambda rng: rng.choice("abcdefghijklmnopqrstuvwxyz"),
        statement=lambda c: (f"Read a word and print how many times the letter '{c}' occurs in it.\n\n"
                             "Input: one line with a word of lowercase letters.\nOutput: one integer."),
        make_input=lambda rng, c: "".join(rng.choice(c + "xyz") for _ in range(rng.randint(1, 15))) + "\n",
        solve=lambda text, c: str(text.strip().count(c)),
        solution=lambda c: f"s = input().strip()\nprint(s.count({c!r}))\n",
    ),
    CodeTemplate(
        name="fibonacci",
        param=lambda rng: rng.choice((10, 100, 1000, 1_000_000_007)),
        statement=lambda m: ("Read n and print the n-th Fibonacci number modulo "
                             f"{m}, where F(0) = 0, F(1) = 1 and F(n) = F(n-1) + F(n-2).\n\n"
                             "Input: one line with an integer n (0 <= n <= 1000).\nOutput: one integer."),
        make_input=lambda rng, _: f"{rng.randint(0, 1000)}\n",
        solve=lambda text, m: str(_fib(int(text), m)),
        solution=lambda m: ("n = int(input())\na, b = 0, 1\nfor _ in range(n):\n"
                            f"    a, b = b, (a + b) % {m}\nprint(a)\n"),
    ),
    CodeTemplate(
        name="sum_list",
        statement=lambda _: ("Read a line of integers separated by spaces and print their sum.\n\n"
                             "Input: one line with 1 to 10 integers.\nOutput: one integer."),
        make_input=_int_list,
        solve=lambda text, _: str(sum(map(int, text.split()))),
        solution=lambda _: "print(sum(map(int, input().split())))\n",
    ),
    CodeTemplate(
        name="palindrome",
        statement=lambda _: ("Read a word and print YES if it reads the same forwards and backwards, "
                             "otherwise NO.\n\nInput: one line with a word of lowercase letters.\n"
                             "Output: YES or NO."),
        make_input=_palindrome_input,
        solve=lambda text, _: "YES" if text.strip() == text.strip()[::-1] else "NO",
        solution=lambda _: "s = input().strip()\nprint('YES' if s == s[::-1] else 'NO')\n",
    ),
)


def _extra_info_fields() -> list[tuple[str, Any]]:
    import pyarrow as pa

    return [("template", pa.string()), ("solution", pa.string()), ("split", pa.string()), ("index", pa.int64())]


def _make_problem(rng: random.Random, template: CodeTemplate) -> tuple[str, list[dict[str, str]], str]:
    """(prompt text, test cases, reference solution) for one problem."""
    param = template.param(rng)
    cases = []
    for _ in range(rng.randint(3, 5)):
        text = template.make_input(rng, param)
        cases.append({"input": text, "output": template.solve(text, param) + "\n"})
    example = cases[0]
    prompt = (f"{template.statement(param)}\n\nExample input:\n{example['input']}\nExample output:\n"
              f"{example['output']}\n{_INSTRUCTIONS}")
    return prompt, cases, template.solution(param)


def _rows(rng: random.Random, count: int, split: str, env_class: str) -> list[dict[str, Any]]:
    rows = []
    for index in range(count):
        template = TEMPLATES[rng.randrange(len(TEMPLATES))]
        prompt, cases, solution = _make_problem(rng, template)
        rows.append({
            "data_source": "synthetic_code",
            "prompt": [{"role": "user", "content": prompt}],
            "env_class": env_class,
            "reward_spec": {"method": "rule", "ground_truth": json.dumps(cases)},
            "extra_info": {"template": template.name, "solution": solution, "split": split, "index": index},
        })
    return rows


def prepare_code(output_dir: str | Path, *, num_train: int = 1000, num_val: int = 100, seed: int = 0,
                 env_class: str = "code") -> dict[str, Path]:
    """Generate and write ``train.parquet`` and ``validation.parquet`` for the ``code`` env
    (``env_class``: the environment the rows name, e.g. a custom env that runs the same tests).

    Returns ``{"train": path, "validation": path}``. Same arguments -> identical files.
    """
    if num_train < 1:
        raise ValueError(f"num_train must be >= 1, got {num_train}")
    if num_val < 0:
        raise ValueError(f"num_val must be >= 0, got {num_val}")
    # Separate streams: validation never depends on num_train.
    val_rows = _rows(random.Random(f"code-validation-{seed}"), num_val, "validation", env_class)
    train_rows = _rows(random.Random(f"code-train-{seed}"), num_train, "train", env_class)
    schema = arrow_schema(_extra_info_fields())
    return {
        split: write_parquet(rows, Path(output_dir) / f"{split}.parquet", schema)
        for split, rows in (("train", train_rows), ("validation", val_rows))
    }
