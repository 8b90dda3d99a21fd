"""Name -> function registries for the pluggable pieces of the RL objective.

The trainer only ever refers to algorithms by the string in its config, so adding
an estimator or a loss is one decorated function, with no trainer change.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, overload

from ridgeline.errors import UserError
from ridgeline.user_modules import load_user_module

F = TypeVar("F", bound=Callable[..., Any])


class UnknownNameError(UserError, KeyError, ValueError):
    """Raised by `Registry.get` for a name nobody registered.

    It is both a KeyError (a failed lookup) and a ValueError (a bad config value),
    so callers can catch whichever they find natural.
    """

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message, wrapping it in quotes.
        return str(self.args[0]) if self.args else ""


class Registry(Generic[F]):
    """A mapping from names to functions of one kind (e.g. "policy loss")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}

    @overload
    def register(self, name: str) -> Callable[[F], F]: ...

    @overload
    def register(self, name: str, fn: F) -> F: ...

    def register(self, name: str, fn: F | None = None) -> Callable[[F], F] | F:
        """Add a function under `name`: as a decorator (`@REGISTRY.register("name")`), or directly,
        SkyRL's `AdvantageEstimatorRegistry.register(name, fn)` form (`REGISTRY.register("name", fn)`).
        The function is returned unchanged.

        Taking a name twice raises ValueError: silently replacing a built-in would make
        a config mean different things depending on import order.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        self._check_free(name)

        def decorator(fn: F) -> F:
            self._check_free(name)
            self._fns[name] = fn
            return fn

        return decorator if fn is None else decorator(fn)

    def unregister(self, name: str) -> None:
        """Remove `name` (a user's registration, e.g. between tests); KeyError if it is not there."""
        del self._fns[name]

    def get(self, name: str) -> F:
        """The function registered as `name`, or, for `"my_pkg.my_module:my_function"`, that
        function imported from the user's module (config values can name one directly)."""
        if isinstance(name, str) and name not in self._fns and ":" in name:
            return self.import_path(name)
        try:
            return self._fns[name]
        except (KeyError, TypeError):
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; available: {', '.join(self.names()) or '(none)'}"
            ) from None

    def import_path(self, path: str) -> F:
        """Import `module:attribute`; errors say what failed (ImportError / AttributeError /
        TypeError), so a config check can quote them."""
        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise ValueError(f"{self.kind} path {path!r} must look like 'my_pkg.my_module:my_function'")
        fn = getattr(importlib.import_module(module_name), attr)
        if not callable(fn):
            raise TypeError(f"{self.kind} path {path!r} names a {type(fn).__name__}, not a function")
        return fn

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"

    def _check_free(self, name: str) -> None:
        if name in self._fns:
            raise ValueError(f"{self.kind} {name!r} is already registered")


ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable[..., Any]] = Registry("KL estimator")
LOSS_REDUCTIONS: Registry[Callable[..., Any]] = Registry("loss reduction")


def _decorator(registry: Registry[Callable[..., Any]], name: str) -> Callable[[F], F]:
    """`@register_*(name)`: registers the function and gives it back with its own type."""
    register = registry.register(name)   # a taken name is refused here, before the function exists

    def decorator(fn: F) -> F:
        register(fn)
        return fn
    return decorator


def register_advantage_estimator(name: str) -> Callable[[F], F]:
    return _decorator(ADVANTAGE_ESTIMATORS, name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    return _decorator(POLICY_LOSSES, name)


def register_kl_estimator(name: str) -> Callable[[F], F]:
    return _decorator(KL_ESTIMATORS, name)


def register_loss_reduction(name: str) -> Callable[[F], F]:
    return _decorator(LOSS_REDUCTIONS, name)


def load_algorithm_modules(modules: Iterable[str]) -> None:
    """Import the user's modules of `trainer.algorithm.algorithm_modules` (dotted names or .py
    files) so that their `register_*` calls run; each runs once per process. Every process that
    looks a registered name up (the trainer, each policy rank) calls this first."""
    for module in modules:
        load_user_module(module, "algorithm module")
