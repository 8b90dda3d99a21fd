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

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, TypeVar, overload

from .base import Env
from .skyrl_gym_env import INSTALL_HINT, SkyRLGymEnv, skyrl_gym_source

__all__ = ["register", "make", "registered_envs", "load_env_module", "EnvFactory", "UnknownEnvError"]


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
    factory = _REGISTRY.get(name)
    gym_id = skyrl_gym_source(name, in_ridgeline=factory is not None,
                              ridgeline_builtin=factory is not None and _is_builtin(factory))
    if gym_id is not None:
        return SkyRLGymEnv(gym_id, extras, **settings)
    if factory is None and ":" in name:
        factory = _import_factory(name)
    if factory is None:
        known = ", ".join(registered_envs()) or "(none)"
        gym = sys.modules.get("skyrl_gym")
        gym_known = ("; skyrl-gym envs: " + ", ".join(sorted(gym.registry)) if gym is not None
                     else f"; skyrl-gym is not installed (for its envs: {INSTALL_HINT})"
                     if importlib.util.find_spec("skyrl_gym") is None else "")
        raise UnknownEnvError(
            f"unknown env {name!r}; registered envs: {known}{gym_known}. "
            "Custom envs must be registered with ridgeline.envs.register or skyrl_gym.register, in a "
            "module listed in environment.env_modules."
        )
    env = factory(extras=extras, **settings)
    if not isinstance(env, Env):
        raise TypeError(f"env factory for {name!r} returned {type(env).__name__}, not a ridgeline.envs.Env")
    return env


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
    """Import a user module so that its ``register`` calls run.

    ``spec`` is either a dotted module name (``"my_pkg.envs"``) or a path to a
    ``.py`` file. File modules get a stable synthetic name derived from the
    resolved path, so loading the same file twice returns the cached module
    instead of executing it again.
    """
    text = str(spec)
    looks_like_path = isinstance(spec, Path) or text.endswith(".py") or "/" in text or "\\" in text
    if not looks_like_path:
        try:
            return importlib.import_module(text)
        except ImportError as exc:
            raise ImportError(f"could not import env module {text!r}: {exc}") from exc

    path = Path(text).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"env module file not found: {text} (resolved to {path})")
    digest = hashlib.sha1(str(path).encode("utf-8")).hexdigest()[:10]
    module_name = f"ridgeline_user_env_{_safe_identifier(path.stem)}_{digest}"
    cached = sys.modules.get(module_name)
    if cached is not None:
        return cached
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"could not load env module from {path}")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before exec so dataclasses/pickling inside the module can find it.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _safe_identifier(stem: str) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in stem)
    return cleaned or "module"
