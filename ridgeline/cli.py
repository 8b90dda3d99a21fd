"""The `ridgeline` command: `ridgeline train [overrides] [--cfg job]`, `ridgeline eval [overrides]`,
`ridgeline sft [overrides]`, `ridgeline dpo [overrides]`,
`ridgeline prepare DATASET ...`, `ridgeline export CHECKPOINT OUT`, `ridgeline report RUN_DIR`,
`ridgeline doctor [overrides] [--json]`,
`ridgeline serve [overrides] [--port N]`; `--debug` anywhere adds tracebacks to error messages,
`ridgeline --version` prints the versions."""

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
    if not debug:   # before the parsers import the libraries: tqdm reads its switch when imported
        from ridgeline.library_noise import silence_library_noise
        silence_library_noise()
    parser = argparse.ArgumentParser(prog="ridgeline", description="RL post-training of language models")
    parser.add_argument("--version", action=_Version, help="print the versions of Ridgeline, Python, torch, "
                        "transformers (and vLLM / SGLang when installed) and exit")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of configuration, data and model errors too "
                             f"(also: {DEBUG_ENV}=1); anywhere on the command line")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run training; arguments are Hydra overrides",
                           description="ridgeline train +experiment=quickstart trainer.epochs=2 ...",
                           epilog=presets_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    # REMAINDER: options may come before, between or after the overrides (picked out in _train_args)
    _add_train_arguments(train, overrides_nargs=argparse.REMAINDER)
    from ridgeline.entrypoints import supervised as supervised_cmd
    supervised_cmd.add_parsers(sub, _add_train_arguments)
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
    from ridgeline.tinker import command as tinker_cmd
    tinker_cmd.add_parser(sub)
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
    if args.command == "tinker":
        from ridgeline.tinker import command as tinker_cmd
        return tinker_cmd.run(args)
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
    from ridgeline.config.loader import config_yaml
    command = args.command
    args = _train_args(args)
    if args.cfg is not None:
        print(config_yaml(args.overrides, resolve=args.resolve, package=args.package), end="")
        return 0
    cfg = load_config(args.overrides)
    if command in ("sft", "dpo"):
        from ridgeline.entrypoints import supervised as supervised_cmd
        supervised_cmd.run(command, cfg)
        return 0
    from ridgeline.entrypoints.run import run_training
    run_training(cfg)
    return 0


class _Version(argparse.Action):
    """`--version`, printed as it is (argparse's own action re-wraps the line)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def version_line() -> str:
    """`ridgeline --version`: Ridgeline's version and the versions of what it runs on, read from the
    installed packages' metadata (nothing is imported, so it answers at once)."""
    import importlib.metadata
    import platform

    from ridgeline import __version__

    parts = [f"Python {platform.python_version()}"]
    for dist in ("torch", "transformers", "vllm", "sglang"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"ridgeline {__version__} ({', '.join(parts)}); configs follow SkyRL-Train 0.3.1"


def presets_epilog() -> str:
    """The presets `+experiment=NAME` can name, each with the first line of its file's comment."""
    from ridgeline.config.loader import preset_summaries

    width = max((len(name) for name in preset_summaries()), default=0)
    lines = [f"  {name.ljust(width)}  {summary}" for name, summary in preset_summaries().items()]
    return ("presets (+experiment=NAME):\n" + "\n".join(lines)
            + "\n\na preset, then keys of your own:        ridgeline train +experiment=quickstart trainer.epochs=2\n"
              "print the config a command line makes:  ridgeline train +experiment=tiny --cfg job")


def _add_train_arguments(parser: argparse.ArgumentParser, overrides_nargs: str = "*") -> None:
    parser.add_argument("--cfg", choices=["job"], default=None,
                        help="print the composed and validated config as YAML and exit, as Hydra's --cfg job")
    parser.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations (${...})")
    parser.add_argument("-p", "--package", default=None,
                        help="with --cfg: print only this part of the config, e.g. trainer.algorithm")
    parser.add_argument("overrides", nargs=overrides_nargs, help="Hydra overrides, e.g. +experiment=tiny trainer.seed=1")


def _train_args(args: argparse.Namespace) -> argparse.Namespace:
    """`ridgeline train`'s options picked out of the overrides, wherever they stand on the line."""
    parser = argparse.ArgumentParser(prog="ridgeline train")
    _add_train_arguments(parser)
    late = parser.parse_intermixed_args(list(args.overrides))
    return argparse.Namespace(overrides=late.overrides, cfg=late.cfg or args.cfg, resolve=late.resolve or args.resolve,
                              package=late.package or args.package)


def entry() -> int:
    """The `ridgeline` command (and `python -m ridgeline.cli`): `main` on tcmalloc when the machine
    has it (`ridgeline.allocator`). `main` itself never re-executes, so callers in-process keep theirs."""
    from ridgeline.allocator import reexec_with_tcmalloc
    reexec_with_tcmalloc()
    return main()


if __name__ == "__main__":
    sys.exit(entry())
