"""Environments: turn a model response into reward (SkyRL-gym style).

Importing this package registers the built-in envs ("gsm8k", "arithmetic").
Standard library only, so it is cheap to import in worker processes.
"""

from .base import Env, SingleTurnEnv, StepOutput
from .registry import UnknownEnvError, load_env_module, make, register, registered_envs

# Imported for their side effect: registering the built-in envs.
from . import arithmetic as _arithmetic  # noqa: E402,F401  isort: skip
from . import gsm8k as _gsm8k  # noqa: E402,F401  isort: skip

__all__ = [
    "Env",
    "SingleTurnEnv",
    "StepOutput",
    "UnknownEnvError",
    "load_env_module",
    "make",
    "register",
    "registered_envs",
]
