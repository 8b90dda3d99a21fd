"""A plain reward function as an environment: `score(response_text, extras) -> float`.

`environment.reward_fn: my_pkg.rewards:score` (or `path/to/file.py:score`) makes every prompt a
single-turn episode scored by that function, with no Env class to write.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .base import SingleTurnEnv
from .registry import EnvFactory, load_env_module

__all__ = ["RewardFunctionEnv", "load_reward_fn", "reward_fn_env"]

ScoreFn = Callable[[str, dict[str, Any]], float]


class RewardFunctionEnv(SingleTurnEnv):
    """Single turn; the reward is `score_fn(response_text, extras)` (extras: the dataset row's
    columns other than prompt and env_class, e.g. `reward_spec["ground_truth"]`)."""

    def __init__(self, extras: dict[str, Any] | None = None, *, score_fn: ScoreFn, **settings: Any) -> None:
        super().__init__(extras, **settings)
        self.score_fn = score_fn

    def score(self, action: str) -> float:
        return self.score_fn(action, self.extras)   # as returned: the generator checks it


def reward_fn_env(score_fn: ScoreFn) -> EnvFactory:
    """An env factory for `make` / `register` that scores with `score_fn`."""
    return functools.partial(RewardFunctionEnv, score_fn=score_fn)


def load_reward_fn(spec: str) -> ScoreFn:
    """`my_pkg.module:function` or `path/to/file.py:function` -> the function."""
    module_spec, sep, name = str(spec).rpartition(":")
    if not sep or not module_spec or not name:
        raise ValueError(f"reward_fn {spec!r} must look like 'my_pkg.module:function' or 'file.py:function'")
    fn = getattr(load_env_module(module_spec), name, None)
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r}: {module_spec} has no function {name!r}")
    return fn
