"""The `ridgeline` command: `ridgeline train [overrides]`, `ridgeline eval [overrides]`,
`ridgeline prepare DATASET ...`, `ridgeline export CHECKPOINT OUT`, `ridgeline report RUN_DIR`,
`ridgeline doctor [overrides] [--json]`,
`ridgeline serve [overrides] [--port N]`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ridgeline", description="RL post-training of language models")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run training; arguments are Hydra overrides",
                           description="ridgeline train +experiment=quickstart trainer.epochs=2 ...")
    train.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=tiny trainer.seed=1")
    from ridgeline.data.cli import add_prepare_parser, run_prepare
    from ridgeline.entrypoints import doctor as doctor_cmd
    from ridgeline.entrypoints import report as report_cmd
    from ridgeline.entrypoints.eval import add_parser as add_eval_parser
    from ridgeline.entrypoints.export import add_parser as add_export_parser
    add_prepare_parser(sub)
    add_eval_parser(sub)
    add_export_parser(sub)
    report_cmd.add_parser(sub)
    doctor_cmd.add_parser(sub)
    from ridgeline.entrypoints import serve as serve_cmd
    serve_cmd.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor_cmd.run(args)
    if args.command == "serve":
        return serve_cmd.run(args)
    if args.command == "report":
        return report_cmd.run(args)
    if args.command == "export":
        from ridgeline.entrypoints.export import run as run_export
        return run_export(args)
    if args.command == "prepare":
        return run_prepare(args)
    if args.command == "eval":
        from ridgeline.entrypoints.eval import run as run_eval
        return run_eval(args)
    from ridgeline.config import ConfigError, load_config
    from ridgeline.entrypoints.run import run_training
    try:
        cfg = load_config(args.overrides)
    except ConfigError as err:
        print(f"ridgeline: invalid configuration\n{err}", file=sys.stderr)
        return 2
    from ridgeline.data import DatasetError
    from ridgeline.trainer.builders import EnvironmentCheckError
    from ridgeline.trainer.checkpoint import CheckpointError
    try:
        run_training(cfg)
    except (CheckpointError, DatasetError, EnvironmentCheckError) as err:  # what the user fixes: one message
        print(f"ridgeline: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print(f"ridgeline: interrupted{': ' + str(err) if str(err) else ''}", file=sys.stderr)
        return 130
    return 0


def entry() -> int:
    """The `ridgeline` command (and `python -m ridgeline.cli`): `main` on tcmalloc when the machine
    has it (`ridgeline.allocator`). `main` itself never re-executes, so callers in-process keep theirs."""
    from ridgeline.allocator import reexec_with_tcmalloc
    reexec_with_tcmalloc()
    return main()


if __name__ == "__main__":
    sys.exit(entry())
