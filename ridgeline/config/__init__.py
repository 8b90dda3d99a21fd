"""Ridgeline configuration: YAML defaults and presets (Hydra), validation, build-support tables.

Importing this package registers the ``ridgeline.default_backend`` OmegaConf resolver used by
``generator.backend`` in ``ppo_base_config.yaml``.
"""

from ridgeline.config.loader import (
    CONFIG_DIR,
    CONFIG_NAME,
    default_backend,
    list_experiments,
    load_config,
)
from ridgeline.config.support import unbuilt_defaults
from ridgeline.config.validate import ConfigError, base_config, config_problems, validate_config

__all__ = [
    "CONFIG_DIR",
    "CONFIG_NAME",
    "ConfigError",
    "base_config",
    "config_problems",
    "default_backend",
    "list_experiments",
    "load_config",
    "unbuilt_defaults",
    "validate_config",
]
