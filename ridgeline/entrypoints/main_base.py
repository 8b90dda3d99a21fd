"""`python -m ridgeline.entrypoints.main_base [overrides]`: the Hydra app (SkyRL's entry point name).

Takes the same overrides as `ridgeline train`, plus Hydra's own flags (`--cfg job`, `--help`)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from ridgeline.config import CONFIG_DIR, ConfigError, validate_config
from ridgeline.config.loader import CONFIG_NAME


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    from ridgeline.entrypoints.run import run_training

    try:
        validate_config(cfg)
    except ConfigError as err:
        print(f"ridgeline: invalid configuration\n{err}", file=sys.stderr)
        sys.exit(2)
    run_training(cfg)


if __name__ == "__main__":
    from ridgeline.allocator import reexec_with_tcmalloc
    reexec_with_tcmalloc()
    main()
