"""`ridgeline report RUN_DIR [-o FILE]`: write a run's self-contained HTML report."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "report", help="write report.html for a run folder",
        description="Write a self-contained HTML report (charts, eval results, sample rollouts) "
                    "from a run folder's metrics.jsonl, samples.jsonl and eval dumps. Works on a "
                    "finished, running or crashed run.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (trainer.run_dir)")
    parser.add_argument("-o", "--output", default=None,
                        help="where to write the page (default: RUN_DIR/report.html)")
    return parser


def run(args: argparse.Namespace) -> int:
    from ridgeline.tracking.report import write_report

    print(write_report(args.run_dir, args.output))  # RunFolderError: reported by the command
    return 0


def main(argv: list[str] | None = None) -> int:
    from ridgeline.entrypoints.command import run_command
    return run_command("report", add_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
