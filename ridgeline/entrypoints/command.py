"""`python -m ridgeline.entrypoints.<command> ...`: one `ridgeline <command>` on its own, parsed and
reported as `ridgeline` does (`--debug` anywhere, a user's error as one message and exit 2), without
importing `ridgeline.cli`, which sits above every command."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from ridgeline.errors import report_user_errors


def run_command(name: str, add_parser: Callable[[Any], object], run: Callable[[argparse.Namespace], int],
                argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the process's) with the command's own parser (`add_parser`, given the
    subparsers of a `ridgeline` parser) and `run` it; its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    parser = argparse.ArgumentParser(prog="ridgeline")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([name, *(arg for arg in argv if arg != "--debug")])
    return report_user_errors(lambda: run(args), f"ridgeline {name}", debug=debug)
