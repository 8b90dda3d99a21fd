"""``prepare`` subcommand: write ready-to-train parquet files.

The main ``ridgeline`` CLI wires this in with :func:`add_prepare_parser`
and :func:`run_prepare`; ``python -m ridgeline.data.cli prepare ...`` works
on its own through :func:`main`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ridgeline.errors import report_user_errors

from .prepare_arithmetic import PROMPT_STYLES
from .prepare_gsm8k import HUB_ID
from .prepare_run import write_dataset

__all__ = ["add_prepare_parser", "run_prepare", "main"]


def add_prepare_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add ``prepare {gsm8k,arithmetic,multiply,text2sql,code}`` to an argparse subparsers object.

    The chosen dataset is stored in ``args.prepare_dataset``; the parser also
    sets ``args.func = run_prepare`` for CLIs that dispatch that way.
    """
    prepare = subparsers.add_parser(
        "prepare",
        help="write train/validation parquet files for a built-in dataset",
        description="Write train.parquet and validation.parquet in the SkyRL row schema.",
    )
    prepare.set_defaults(func=run_prepare)
    datasets = prepare.add_subparsers(dest="prepare_dataset", metavar="DATASET", required=True)

    gsm8k = datasets.add_parser("gsm8k", help="GSM8K grade-school math (train + test as validation)")
    gsm8k.add_argument("--output", required=True, type=Path, help="directory to write the parquet files into")
    gsm8k.add_argument(
        "--input",
        type=Path,
        default=None,
        help=f"directory with train.jsonl and test.jsonl; if omitted, download {HUB_ID} from the Hugging Face Hub",
    )
    gsm8k.add_argument("--env-class", default="gsm8k",
                       help="env the rows name: gsm8k (skyrl-gym's scoring, default) or gsm8k_lenient")

    arith = datasets.add_parser("arithmetic", help="generated integer arithmetic with difficulty knobs")
    arith.add_argument("--output", required=True, type=Path, help="directory to write the parquet files into")
    arith.add_argument("--num-train", type=int, default=2000, help="training problems (default: 2000)")
    arith.add_argument("--num-val", type=int, default=200, help="held-out validation problems (default: 200)")
    arith.add_argument("--min-operand", type=int, default=1, help="smallest operand, inclusive (default: 1)")
    arith.add_argument("--max-operand", type=int, default=30, help="largest operand, inclusive (default: 30)")
    arith.add_argument("--ops", default="+", help="operators to use, from '+-*' (default: '+')")
    arith.add_argument("--num-operands", type=int, default=2, help="operands per problem (default: 2)")
    arith.add_argument("--seed", type=int, default=0, help="generation seed (default: 0)")
    arith.add_argument(
        "--prompt-style",
        choices=sorted(PROMPT_STYLES),
        default="direct",
        help="'direct': answer with just the number; 'hash': answer after '####' (default: direct)",
    )

    mult = datasets.add_parser("multiply", help="generated n-digit multiplication, answer in \\boxed{} (SkyRL's example)")
    mult.add_argument("--output", required=True, type=Path, help="directory to write the parquet files into")
    mult.add_argument("--num-train", type=int, default=2000, help="training problems (default: 2000)")
    mult.add_argument("--num-val", type=int, default=200, help="held-out validation problems (default: 200)")
    mult.add_argument("--num-digits", type=int, default=3, help="digits per operand (default: 3)")
    mult.add_argument("--seed", type=int, default=0, help="generation seed (default: 0)")
    mult.add_argument("--env-class", default="multiply",
                      help="env the rows name: multiply (SkyRL's example scoring, default) or multiply_lenient")

    text2sql = datasets.add_parser(
        "text2sql", help="synthetic text-to-SQL questions on a generated SQLite database (env text2sql_lenient)")
    text2sql.add_argument("--output", required=True, type=Path,
                          help="directory to write databases/ and the parquet files into")
    text2sql.add_argument("--num-train", type=int, default=None, help="training rows (default: every question not held out)")
    text2sql.add_argument("--num-val", type=int, default=40, help="held-out validation questions (default: 40)")
    text2sql.add_argument("--seed", type=int, default=0, help="seed of the train/validation split (default: 0)")

    code = datasets.add_parser("code", help="generated stdin/stdout Python problems for the code env")
    code.add_argument("--output", required=True, type=Path, help="directory to write the parquet files into")
    code.add_argument("--num-train", type=int, default=1000, help="training problems (default: 1000)")
    code.add_argument("--num-val", type=int, default=100, help="held-out validation problems (default: 100)")
    code.add_argument("--seed", type=int, default=0, help="generation seed (default: 0)")
    return prepare


def _count_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.read_metadata(path).num_rows


def _settings(args: argparse.Namespace) -> dict[str, object]:
    """The command's flags as `data.prepare` options of its dataset (`write_dataset` runs both)."""
    common = {"dataset": args.prepare_dataset}
    if args.prepare_dataset == "gsm8k":
        return {**common, "input_dir": args.input, "env_class": args.env_class}
    sized = {**common, "num_train": args.num_train, "num_val": args.num_val, "seed": args.seed}
    if args.prepare_dataset == "arithmetic":
        return {**sized, "min_operand": args.min_operand, "max_operand": args.max_operand, "ops": args.ops,
                "num_operands": args.num_operands, "prompt_style": args.prompt_style}
    if args.prepare_dataset == "multiply":
        return {**sized, "num_digits": args.num_digits, "env_class": args.env_class}
    return sized   # text2sql, code


def run_prepare(args: argparse.Namespace) -> int:
    """Run the chosen ``prepare`` command; print files and row counts. Returns an exit code."""
    written = write_dataset(args.output, _settings(args), "ridgeline prepare")
    for split, path in written.items():
        if path.is_dir():  # text2sql's databases folder
            print(f"{split}: {path} (set environment.skyrl_gym.text2sql_lenient.db_root to this folder)")
        else:
            print(f"{split}: {path} ({_count_rows(path)} rows)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m ridgeline.data.cli prepare ...``."""
    parser = argparse.ArgumentParser(prog="python -m ridgeline.data.cli", description="Ridgeline data tools.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_prepare_parser(subparsers)
    args = parser.parse_args(argv)
    return report_user_errors(lambda: run_prepare(args), "ridgeline prepare")


if __name__ == "__main__":
    sys.exit(main())
