"""A plain reward function as an environment, in either of two signatures.

`environment.reward_fn: my_pkg.rewards:score` (or `path/to/file.py:score`) makes every prompt a
single-turn episode scored by that function, with no Env class to write. The function is either

* Ridgeline's `score(response_text, extras) -> float` (extras: the row's columns but prompt and
  env_class), or
* TRL's reward function, recognised by a parameter named `completions`:
  `reward_func(completions, prompts=..., **columns) -> list[float]`. TRL passes a batch; here each
  call is a batch of one trajectory, in TRL's conversational format (Ridgeline's prompts are chat
  messages): `prompts=[messages]`, `completions=[[{"role": "assistant", "content": text}]]`, and each
  dataset column as a keyword argument holding a one-element list (`reward_spec=[{...}]`, ...).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import Message, SingleTurnEnv
from .registry import EnvFactory, load_env_module

__all__ = ["RewardFunction", "RewardFunctionEnv", "load_reward_fn", "reward_fn_env"]

SIGNATURES = ("score(response_text, extras) -> float, or TRL's reward_func(completions, prompts, **columns) "
              "-> list[float]")


@dataclass(frozen=True)
class RewardFunction:
    """A user's reward function and the convention it is called in (`trl`: TRL's keyword batch)."""

    fn: Callable[..., Any]
    trl: bool

    def __call__(self, text: str, prompt: list[Message], extras: dict[str, Any]) -> Any:
        if not self.trl:
            return self.fn(text, extras)
        columns = {name: [value] for name, value in extras.items() if name not in ("prompts", "completions")}
        rewards = self.fn(prompts=[prompt], completions=[[{"role": "assistant", "content": text}]], **columns)
        if not isinstance(rewards, (list, tuple)) or len(rewards) != 1:
            raise ValueError(f"a TRL-style reward function returns one reward per completion: it was given 1 "
                             f"completion and returned {_shown(rewards)}")
        return rewards[0]   # as returned: the generator checks it is a number


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class RewardFunctionEnv(SingleTurnEnv):
    """Single turn; the reward is the reward function's value for the response (extras: the dataset
    row's columns other than prompt and env_class, e.g. `reward_spec["ground_truth"]`)."""

    def __init__(self, extras: dict[str, Any] | None = None, *, score_fn: RewardFunction, **settings: Any) -> None:
        super().__init__(extras, **settings)
        self.score_fn = score_fn
        self.prompt: list[Message] = []

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        self.prompt = prompt   # TRL's reward functions see the prompt
        return prompt, {}

    def score(self, action: str) -> float:
        return self.score_fn(action, self.prompt, self.extras)   # as returned: the generator checks it


def reward_fn_env(score_fn: RewardFunction) -> EnvFactory:
    """An env factory for `make` / `register` that scores with `score_fn`."""
    return functools.partial(RewardFunctionEnv, score_fn=score_fn)


def load_reward_fn(spec: str) -> RewardFunction:
    """`my_pkg.module:function` or `path/to/file.py:function` -> the function, with its convention."""
    module_spec, sep, name = str(spec).rpartition(":")
    if not sep or not module_spec or not name:
        raise ValueError(f"reward_fn {spec!r} must look like 'my_pkg.module:function' or 'file.py:function'")
    fn = getattr(load_env_module(module_spec), name, None)
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r}: {module_spec} has no function {name!r}")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):   # a builtin without a signature: called the Ridgeline way
        return RewardFunction(fn, trl=False)
    if "completions" in params:
        return RewardFunction(fn, trl=True)
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_two = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params.values())
    if not takes_two:
        raise ValueError(f"reward_fn {spec!r}: {name}{inspect.signature(fn)} takes neither signature Ridgeline "
                         f"calls: {SIGNATURES}")
    return RewardFunction(fn, trl=False)
