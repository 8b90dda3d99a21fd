"""The `ridgeline` command: `ridgeline train [overrides]`, `ridgeline eval [overrides]`,
`ridgeline prepare DATASET ...`, `ridgeline export CHECKPOINT OUT`, `ridgeline report RUN_DIR`,
`ridgeline doctor [overrides] [--json]`,
`ridgeline serve [overrides] [--port N]`; `--debug` anywhere adds tracebacks to error messages."""

from __future__ import annotations

import argparse
import sys

from ridgeline.errors import DEBUG_ENV, report_user_errors


def main(argv: list[str] | None = None) -> int:
    """Run one `ridgeline` command; its exit code. Errors a user fixes (`ridgeline.errors.UserError`:
    config, data, model paths, environments, a locked run folder, a full disk) are one message and
    exit code 2 (`report_user_errors`); `--debug`, anywhere on the line, adds their traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # taken out before parsing: Hydra overrides never start with "--", and this way the flag works
    # before or after the command and between overrides alike
    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]
    parser = argparse.ArgumentParser(prog="ridgeline", description="RL post-training of language models")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of configuration, data and model errors too "
                             f"(also: {DEBUG_ENV}=1); anywhere on the command line")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run training; arguments are Hydra overrides",
                           description="ridgeline train +experiment=quickstart trainer.epochs=2 ...")
    train.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=tiny trainer.seed=1")
    from ridgeline.data.cli import add_prepare_parser
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
    prog = "ridgeline" if args.command == "train" else f"ridgeline {args.command}"
    return report_user_errors(lambda: _run(args), prog, debug=debug)


def _run(args: argparse.Namespace) -> int:
    if args.command == "doctor":
        from ridgeline.entrypoints import doctor as doctor_cmd
        return doctor_cmd.run(args)
    if args.command == "serve":
        from ridgeline.entrypoints import serve as serve_cmd
        return serve_cmd.run(args)
    if args.command == "report":
        from ridgeline.entrypoints import report as report_cmd
        return report_cmd.run(args)
    if args.command == "export":
        from ridgeline.entrypoints.export import run as run_export
        return run_export(args)
    if args.command == "prepare":
        from ridgeline.data.cli import run_prepare
        return run_prepare(args)
    if args.command == "eval":
        from ridgeline.entrypoints.eval import run as run_eval
        return run_eval(args)
    from ridgeline.config import load_config
    from ridgeline.entrypoints.run import run_training
    run_training(load_config(args.overrides))
    return 0


def entry() -> int:
    """The `ridgeline` command (and `python -m ridgeline.cli`): `main` on tcmalloc when the machine
    has it (`ridgeline.allocator`). `main` itself never re-executes, so callers in-process keep theirs."""
    from ridgeline.allocator import reexec_with_tcmalloc
    reexec_with_tcmalloc()
    return main()


if __name__ == "__main__":
    sys.exit(entry())
