"""`python -m ridgeline.entrypoints.main_base [overrides]`: SkyRL's entry point name.

Overrides go through the same loader as `ridgeline train` (`ridgeline.config.load_config`), so a
SkyRL script's command line is read the same way by both: `trainer.resume_mode=null`, free-form
per-env keys without '+', Megatron settings named once. Hydra's own flags (`--cfg job`, `--help`,
...) run the Hydra app below instead."""

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


if __name__ == "__main__":
    from ridgeline.allocator import reexec_with_tcmalloc
    reexec_with_tcmalloc()
    if any(arg.startswith("-") and arg != "--debug" for arg in sys.argv[1:]):
        main()  # Hydra's flags
    else:
        from ridgeline import cli
        sys.exit(cli.main(["train", *sys.argv[1:]]))
