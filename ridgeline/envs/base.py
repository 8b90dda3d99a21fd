"""Environment interface: how a rollout turns model text into reward.

The shape follows the SkyRL-gym convention so users can port environments
with little change: an env is built per rollout from the dataset row
(``extras``) plus per-env config (``settings``), may rewrite the prompt in
``init``, and is stepped with the model's response text until ``done``.
Multi-turn envs return new chat messages as ``observations``; single-turn
envs (the common rule-based-reward case) use :class:`SingleTurnEnv`.

This module imports only the standard library so that envs can be loaded in
lightweight worker processes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["Env", "EnvOutputError", "SingleTurnEnv", "StepOutput", "Message", "exception_text", "mean_of_numbers",
           "short_repr"]

Message = dict[str, str]
"""A chat message: {"role": "system" | "user" | "assistant", "content": str}."""


class EnvOutputError(ValueError):
    """An environment returned something that breaks the contract of :class:`StepOutput` (or of
    ``init`` / ``get_metrics``). ``field`` names the part (``reward``, ``done``, ``observations``,
    ``metadata``, ``prompt``, ``metrics`` or ``type``); the message says what was wrong and how to
    return it instead. The generator scores the trajectory 0 and counts it in
    ``generate/env_bad_outputs``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about user values: never raises
    (a ``__repr__`` that fails, an int too long to print) and never floods a log line."""
    try:
        text = repr(value)
    except Exception:  # a user object's __repr__, or an int beyond sys.get_int_max_str_digits()
        bits = f" of {value.bit_length()} bits" if isinstance(value, int) else ""
        text = f"<{type(value).__name__}{bits}>"
    return _cut(text, limit)


def exception_text(exc: BaseException, limit: int = 300, *, with_type: bool = True) -> str:
    """``"<Type>: <message>"`` (or the message alone) of a user exception, cut to ``limit``
    characters; never raises."""
    try:
        message = str(exc)
    except Exception:  # a user exception whose __str__ fails
        message = "<str() failed>"
    return _cut(f"{type(exc).__name__}: {message}" if with_type else message, limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass
class StepOutput:
    """Result of one env step.

    observations: chat messages to append before the next model turn (empty
        when ``done``): ``{"role": str, "content": str}`` (other keys: short strings).
    reward: scalar reward for this step: a finite int or float (not a bool) within float32's range.
    done: whether the episode has ended (a bool).
    metadata: free-form diagnostics (e.g. the parsed answer) for logging: a dict that
        ``json.dumps(..., default=str)`` can write.

    The generator checks every field of what ``step`` returns (``generation.env_outputs``): a
    value that breaks these rules costs the trajectory its reward (0), is counted and logged.
    """

    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    """Base class for environments.

    Args:
        extras: the dataset row's columns other than ``prompt`` and
            ``env_class`` (``data_source``, ``reward_spec``, ``extra_info``,
            and any custom columns). Ground truth lives here.
        max_turns: how many model turns the episode may take (default
            ``default_max_turns`` of the class; ``environment.skyrl_gym.<name>.max_turns``
            in the config). The generator also stops at ``generator.max_turns``.
        **settings: per-env configuration (``environment.skyrl_gym.<name>``).

    Subclasses that take no configuration can set ``accepted_settings = ()``
    (or a tuple of names) so a typo in the config fails loudly instead of
    being ignored; the default ``None`` accepts anything. ``max_turns`` is
    always accepted.

    Turn counting: ``step`` implementations call :meth:`next_turn` once per
    call; it returns True when that turn is the last one allowed, so a
    multi-turn env knows to end the episode (``done=True``) there.
    """

    accepted_settings: ClassVar[tuple[str, ...] | None] = None
    default_max_turns: ClassVar[int] = 1

    def __init__(self, extras: dict[str, Any] | None = None, *, max_turns: int | None = None,
                 **settings: Any) -> None:
        if self.accepted_settings is not None:
            unknown = sorted(set(settings) - set(self.accepted_settings))
            if unknown:
                accepted = ", ".join(("max_turns",) + tuple(self.accepted_settings))
                raise TypeError(
                    f"{type(self).__name__} got unknown settings {unknown}; accepted settings: {accepted}"
                )
        self.extras: dict[str, Any] = dict(extras or {})
        self.settings: dict[str, Any] = dict(settings)
        self.max_turns: int = int(self.default_max_turns if max_turns is None else max_turns)
        if self.max_turns < 1:
            raise ValueError(f"{type(self).__name__}: max_turns must be at least 1, got {max_turns}")
        self.turns: int = 0

    def next_turn(self) -> bool:
        """Count one model turn; True when it is the last one ``max_turns`` allows."""
        self.turns += 1
        return self.turns >= self.max_turns

    def get_metrics(self) -> dict[str, Any]:
        """Numbers about the finished episode (e.g. ``tool_calls``, ``sql_errors``), combined over a
        step's episodes of this env class by :meth:`aggregate_metrics` and logged as
        ``environment/<key>`` (SkyRL's name; a key several env classes report also per class,
        ``environment/<env_class>/<key>``). Default: none."""
        return {}

    def aggregate_metrics(self, episodes: list[dict[str, Any]]) -> dict[str, float]:
        """How this env's class combines the ``get_metrics()`` dicts of a step's episodes (called on
        one of them; skyrl-gym's ``aggregate_metrics``). Default, as skyrl-gym's: the mean of each
        number (bools as 0/1) over the episodes that report it; other values are left out."""
        return mean_of_numbers(episodes)

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        """Called once before generation; may rewrite the prompt.

        Returns the (possibly modified) prompt messages and metadata. The
        default leaves the prompt unchanged.
        """
        return prompt, {}

    @abstractmethod
    def step(self, action: str) -> StepOutput:
        """Consume the model's response text and return the next step."""

    def close(self) -> None:
        """Release resources (subprocesses, sandboxes). Default: nothing."""

    def unscorable(self) -> str | None:
        """Why no answer could ever earn this row's reward, when the row's own reference is broken
        (e.g. a gold query that fails on its database): checked before training, after `init`, so
        such a row stops the run instead of scoring 0 for ever. None (the default): nothing known."""
        return None


class SingleTurnEnv(Env):
    """One response, one reward: the rule-based-reward case.

    Subclasses implement :meth:`score`, and optionally :meth:`parse` to
    expose what was read from the response (reported as
    ``metadata["parsed"]``, which makes reward bugs visible in logs).
    ``step`` ends the episode immediately with no observations.
    """

    @abstractmethod
    def score(self, action: str) -> float:
        """Reward for a response. Must not raise on arbitrary text."""

    def parse(self, action: str) -> Any:
        """What the env read from the response (for metadata). Default: None."""
        return None

    def step(self, action: str) -> StepOutput:
        if not isinstance(action, str):
            action = "" if action is None else str(action)
        self.next_turn()
        reward = self.score(action)   # as returned: the generator checks it is a number (not a bool)
        metadata: dict[str, Any] = {"parsed": self.parse(action)}
        metadata.update(self.step_metadata())
        return StepOutput(observations=[], reward=reward, done=True, metadata=metadata)

    def step_metadata(self) -> dict[str, Any]:
        """Extra metadata added to every step (e.g. the ground truth)."""
        return {}


def mean_of_numbers(episodes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per key, the mean of the finite numbers (bools as 0/1) the episodes report under it."""
    values: dict[str, list[float]] = {}
    for episode in episodes:
        for key, value in episode.items():
            if isinstance(value, (bool, int, float)) and _fits_float(value):
                values.setdefault(str(key), []).append(float(value))
    return {key: sum(vs) / len(vs) for key, vs in values.items()}


def _fits_float(value: bool | int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float's range
        return False
