"""Ridgeline configuration: the typed schema (SkyRL-Train 0.3.1's keys), presets (Hydra), validation.

Importing this package registers the ``ridgeline.default_backend`` OmegaConf resolver used by
``generator.backend`` and the base config (``ppo_base_config``) in Hydra's config store.
"""

from ridgeline.config.loader import (
    CONFIG_DIR,
    CONFIG_NAME,
    default_backend,
    list_experiments,
    load_config,
    save_config,
    saved_config,
    saved_values,
)
from ridgeline.config.schema import RidgelineConfig, base_config
from ridgeline.config.support import unbuilt_defaults
from ridgeline.config.validate import ConfigError, config_problems, validate_config

__all__ = [
    "CONFIG_DIR",
    "CONFIG_NAME",
    "ConfigError",
    "RidgelineConfig",
    "base_config",
    "config_problems",
    "default_backend",
    "list_experiments",
    "load_config",
    "save_config",
    "saved_config",
    "saved_values",
    "unbuilt_defaults",
    "validate_config",
]
