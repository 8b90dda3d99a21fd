"""`python -m ridgeline.entrypoints.main_base [overrides]`: SkyRL's entry point name.

Overrides go through the same loader as `ridgeline train` (`ridgeline.config.load_config`), so a
SkyRL script's command line is read the same way by both: `trainer.resume_mode=null`, free-form
per-env keys without '+', Megatron settings named once; `--cfg job` (with `--resolve`, `--package`)
prints what that loader makes. Hydra's other flags (`--help`, `--info`, `--cfg all`, ...) run the
Hydra app below."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from ridgeline.config import CONFIG_DIR, validate_config
from ridgeline.config.loader import CONFIG_NAME
from ridgeline.errors import report_user_errors


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    from ridgeline.entrypoints.run import run_training

    def train() -> int:
        run_training(validate_config(cfg))
        return 0

    code = report_user_errors(train, "ridgeline")  # the same one message per user error as `ridgeline train`
    if code:
        sys.exit(code)


# The flags `ridgeline train` reads itself: `--cfg job` then prints the config the same loader makes
# (SkyRL 0.4's names and '+'-less keys read), where Hydra's own app would refuse those overrides.
TRAIN_FLAGS = {"--debug", "--cfg", "--resolve", "-p", "--package"}


def reads_as_train(argv: list[str]) -> bool:
    """`argv` holds no flag but `ridgeline train`'s (`--cfg` only as `job`): the loader runs it."""
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if not flag.startswith("-"):
            continue
        if flag not in TRAIN_FLAGS:
            return False
        if flag == "--cfg" and (value or (argv[i + 1] if i + 1 < len(argv) else "")) != "job":
            return False
    return True


if __name__ == "__main__":
    from ridgeline.allocator import reexec_with_tcmalloc
    reexec_with_tcmalloc()
    if reads_as_train(sys.argv[1:]):
        from ridgeline import cli
        sys.exit(cli.main(["train", *sys.argv[1:]]))
    main()  # Hydra's other flags (--help, --info, --cfg all, -m, ...)
