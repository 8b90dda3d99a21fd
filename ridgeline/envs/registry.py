"""Name -> environment registry.

Dataset rows name their environment in ``env_class``; the trainer calls
:func:`make` with that name. Built-in envs register on import of
``ridgeline.envs``; user envs register by calling :func:`register` in a
module that :func:`load_env_module` imports (from config), so no Ridgeline
code has to change to add an environment.

Note: the registry is per process. Worker processes that build envs must
import the same user modules (call ``load_env_module`` again there).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, TypeVar, overload

from ridgeline.user_modules import load_user_module

from .base import Env
from .skyrl_gym_env import INSTALL_HINT, SkyRLGymEnv, skyrl_gym_source

__all__ = ["DEFAULT_ENV_CLASS", "SKYRL_GYM_DEFAULTS", "register", "make", "check_env_name", "registered_envs",
           "load_env_module", "EnvFactory", "UnknownEnvError"]

# SkyRL 0.3.1's environment.env_class default: the env of rows that name none
DEFAULT_ENV_CLASS = "gsm8k"

# SkyRL's defaults for skyrl-gym's envs (0.3.1's skyrl_gym_config/default.yaml, 0.4's SkyRLGymConfig):
# the settings its search, text2sql and LLM-as-a-judge envs read when a script leaves them out
SKYRL_GYM_DEFAULTS: dict[str, object] = {
    "max_env_workers": 32,
    "text2sql": {"db_path": "/home/ray/default/sql_data"},
    "llm_as_a_judge": {"model": "gpt-4o-mini", "base_url": None},   # base_url: e.g. http://localhost:8000/v1
    "search": {"log_requests": False, "search_url": "http://127.0.0.1:8000/retrieve", "topk": 3, "timeout": 30},
}


class UnknownEnvError(KeyError):
    """``make`` was asked for a name nobody registered.

    A KeyError (it is a failed lookup) whose str() is the plain message
    rather than KeyError's quoted repr.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

EnvFactory = Callable[..., Env]
"""An Env subclass or any callable ``(extras=..., **settings) -> Env``."""

_F = TypeVar("_F", bound=Callable[..., Any])

_REGISTRY: dict[str, EnvFactory] = {}


def _identity(obj: Any) -> tuple[str | None, str | None]:
    return getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)


@overload
def register(name: str) -> Callable[[_F], _F]: ...
@overload
def register(name: str, cls_or_factory: _F, *, overwrite: bool = False) -> _F: ...


def register(name: str, cls_or_factory: Any = None, *, overwrite: bool = False) -> Any:
    """Register an env class or factory under ``name``.

    Usable directly (``register("mine", MyEnv)``) or as a decorator
    (``@register("mine")``). Registering a *different* object under a taken
    name raises unless ``overwrite=True``, because two envs silently
    shadowing each other would make rewards depend on import order.
    Re-registering the same definition (e.g. a module imported twice) is
    allowed.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"env name must be a non-empty string, got {name!r}")

    def _do_register(obj: _F) -> _F:
        if not callable(obj):
            raise TypeError(f"register({name!r}, ...) needs an Env class or factory, got {type(obj).__name__}")
        existing = _REGISTRY.get(name)
        if (
            existing is not None
            and not overwrite
            and existing is not obj
            and _identity(existing) != _identity(obj)
        ):
            raise ValueError(
                f"env {name!r} is already registered to {_describe(existing)}; "
                f"pass overwrite=True to replace it with {_describe(obj)}"
            )
        _REGISTRY[name] = obj
        return obj

    if cls_or_factory is None:
        return _do_register
    return _do_register(cls_or_factory)


def _describe(obj: Any) -> str:
    module, qualname = _identity(obj)
    return f"{module}.{qualname}" if module and qualname else repr(obj)


def registered_envs() -> list[str]:
    """Sorted names of all registered environments."""
    return sorted(_REGISTRY)


def make(name: str, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None,
         **settings: Any) -> Env:
    """Build the env named ``name`` for one rollout.

    ``env_config`` holds the env's settings (``environment.skyrl_gym.<name>``); they reach the
    constructor as keyword arguments, together with any given as ``**settings``. Names resolve as
    :func:`ridgeline.envs.skyrl_gym_env.skyrl_gym_source` says: ``skyrl_gym:<id>`` and names only
    skyrl-gym knows build skyrl-gym's env (wrapped as a :class:`SkyRLGymEnv`), a name user code
    registered with ``skyrl_gym.register`` wins over a Ridgeline built-in, and the rest come from
    Ridgeline's registry. A name of the form ``my_pkg.my_module:MyEnv`` imports that class (or
    factory) without registering it.
    """
    settings = {**dict(env_config or {}), **settings}
    gym_id, factory = _resolve(name)
    if gym_id is not None:
        return SkyRLGymEnv(gym_id, extras, **settings)
    assert factory is not None
    env = factory(extras=extras, **settings)
    if not isinstance(env, Env):
        raise TypeError(f"env factory for {name!r} returned {type(env).__name__}, not a ridgeline.envs.Env")
    return env


def check_env_name(name: str) -> None:
    """Resolve `name` as :func:`make` does, without building anything: UnknownEnvError (listing
    the envs there are) for a name no registry knows."""
    _resolve(name)


def _resolve(name: str) -> tuple[str | None, EnvFactory | None]:
    """(skyrl-gym id, None) for an env skyrl-gym builds, else (None, the factory); UnknownEnvError
    for a name nobody registered."""
    factory = _REGISTRY.get(name)
    gym_id = skyrl_gym_source(name, in_ridgeline=factory is not None,
                              ridgeline_builtin=factory is not None and _is_builtin(factory))
    if gym_id is not None:
        return gym_id, None
    if factory is None and ":" in name:
        factory = _import_factory(name)
    if factory is None:
        known = ", ".join(registered_envs()) or "(none)"
        gym = sys.modules.get("skyrl_gym")
        gym_known = ("; skyrl-gym envs: " + ", ".join(sorted(gym.registry)) if gym is not None
                     else f"; skyrl-gym is not installed (for its envs: {INSTALL_HINT})"
                     if importlib.util.find_spec("skyrl_gym") is None else "")
        raise UnknownEnvError(
            f"unknown env {name!r}; registered envs: {known}{gym_known}. Fix: one of those, or register "
            "a custom env with ridgeline.envs.register or skyrl_gym.register, in a module listed in "
            "environment.env_modules.")
    return None, factory


def _is_builtin(factory: EnvFactory) -> bool:
    """Registered by Ridgeline itself (its gsm8k, text2sql, ...), not by user code."""
    return str(_identity(factory)[0] or "").startswith("ridgeline.")


def _import_factory(path: str) -> EnvFactory:
    module_name, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownEnvError(f"env {path!r} could not be imported ({type(exc).__name__}: {exc})") from None
    if not callable(factory):
        raise UnknownEnvError(f"env {path!r} names a {type(factory).__name__}, not an Env class or factory")
    gym = sys.modules.get("skyrl_gym")
    if gym is not None and isinstance(factory, type) and issubclass(factory, gym.Env):
        raise UnknownEnvError(f"env {path!r} is a skyrl-gym env: register it with skyrl_gym.register(id=..., "
                              "entry_point=...) in a module of environment.env_modules and name its id")
    return factory


def load_env_module(spec: str | Path) -> ModuleType:
    """Import a user module so that its ``register`` calls run: a dotted module name
    (``"my_pkg.envs"``) or a path to a ``.py`` file, imported once per process
    (``ridgeline.user_modules.load_user_module``)."""
    return load_user_module(spec, "env module")
