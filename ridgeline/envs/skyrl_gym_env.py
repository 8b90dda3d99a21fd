"""skyrl-gym envs run unchanged: the adapter that makes one a Ridgeline :class:`Env`.

A skyrl-gym env (a ``skyrl_gym.envs.base_text_env.BaseTextEnv`` subclass registered with
``skyrl_gym.register``) is built as SkyRL-Train's generator builds it:
``skyrl_gym.make(id, env_config=<environment.skyrl_gym.<id> as a DictConfig>, extras=<the row
minus prompt/env_class, plus max_turns>)``; ``init``, ``step``, ``get_metrics``, ``close`` and the
class's ``aggregate_metrics`` (how a step's episodes combine into ``environment/<key>``) are
forwarded, their return values as they are: the generator checks them as it checks any env's
(``generation.env_outputs``: a finite number reward, a bool done, {role, content} string messages,
a JSON-able metadata dict), so a skyrl-gym env that breaks the contract costs its trajectory the
reward and is logged, the same as a Ridgeline env. Ridgeline's generator tokenizes the
observations itself (token-in / token-out), so a ``postprocessed_action`` cannot replace the
sampled tokens: it is kept in the step metadata and logged once.

Which registry a name comes from (:func:`skyrl_gym_source`): ``skyrl_gym:<id>`` always means
skyrl-gym's; a plain name registered in skyrl-gym by user code wins over a Ridgeline built-in of
the same name (logged once); otherwise Ridgeline's registry first, then skyrl-gym's built-ins.

skyrl-gym (and its pandas) is imported only when a name needs it, so this module stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from .base import Env, EnvOutputError, Message, StepOutput, mean_of_numbers, short_repr

__all__ = ["PREFIX", "SkyRLGymEnv", "SkyRLGymNotInstalled", "skyrl_gym_module", "skyrl_gym_source"]

log = logging.getLogger(__name__)

PREFIX = "skyrl_gym:"
"""``env_class: skyrl_gym:<id>`` names skyrl-gym's env ``<id>`` even where Ridgeline has one too."""

INSTALL_HINT = "pip install 'ridgeline[skyrl-gym]'"


class SkyRLGymNotInstalled(ImportError):
    """An env_class needs skyrl-gym, which cannot be imported."""


def skyrl_gym_module(env_class: str) -> ModuleType:
    """``import skyrl_gym``, or an error naming ``env_class`` and the install command."""
    try:
        return importlib.import_module("skyrl_gym")
    except ImportError as exc:
        raise SkyRLGymNotInstalled(
            f"env_class {env_class!r} is a skyrl-gym env, but skyrl-gym cannot be imported ({exc}); "
            f"install it with: {INSTALL_HINT}") from exc


def _is_skyrl_gym_builtin(entry_point: Any) -> bool:
    """True when a skyrl-gym registration points into the skyrl_gym package itself (its gsm8k,
    text2sql, search, ...), False for one user code made."""
    module = entry_point.partition(":")[0] if isinstance(entry_point, str) else getattr(entry_point, "__module__", "")
    return module == "skyrl_gym" or str(module).startswith("skyrl_gym.")


_announced: set[str] = set()


def skyrl_gym_source(name: str, in_ridgeline: bool, ridgeline_builtin: bool) -> str | None:
    """The skyrl-gym id to build for env_class ``name``, or None when Ridgeline's registry serves it.

    in_ridgeline: Ridgeline's registry has ``name``; ridgeline_builtin: that entry is one of
    Ridgeline's own (not registered by user code).

    Raises:
        SkyRLGymNotInstalled: ``skyrl_gym:<id>`` without skyrl-gym installed.
        ValueError: user code registered ``name`` in both registries (which one to run would be a
            guess).
    """
    if name.startswith(PREFIX):
        skyrl_gym_module(name)
        return name[len(PREFIX):]
    if in_ridgeline and sys.modules.get("skyrl_gym") is None:
        return None  # nobody imported skyrl-gym, so nobody registered anything in it
    if not in_ridgeline and importlib.util.find_spec("skyrl_gym") is None:
        return None  # the caller's "unknown env" error mentions the install command
    spec = skyrl_gym_module(name).registry.get(name)
    if spec is None:
        return None
    if not in_ridgeline:
        return name
    if _is_skyrl_gym_builtin(spec.entry_point):
        return None  # Ridgeline's gsm8k / gsm8k_multi_turn / text2sql score exactly as these
    if not ridgeline_builtin:
        raise ValueError(
            f"env {name!r} is registered twice by user code, with ridgeline.envs.register and with "
            f"skyrl_gym.register ({spec.entry_point!r}); rename one of them")
    if name not in _announced:
        _announced.add(name)
        log.info("env_class %r: the skyrl_gym.register-ed %r is used, not Ridgeline's built-in %r",
                 name, spec.entry_point, name)
    return name


class SkyRLGymEnv(Env):
    """A skyrl-gym env behind Ridgeline's :class:`Env` interface.

    Args:
        env_id: the skyrl-gym registry id.
        extras: the row minus prompt/env_class; ``max_turns`` is added as SkyRL's generator does.
        max_turns: the episode's turn limit (``generator.max_turns``, or
            ``environment.skyrl_gym.<id>.max_turns``).
        **settings: ``environment.skyrl_gym.<id>``, handed to the env as ``env_config`` (a
            DictConfig, since skyrl-gym envs read it by attribute).
    """

    def __init__(self, env_id: str, extras: dict[str, Any] | None = None, *, max_turns: int | None = None,
                 **settings: Any) -> None:
        super().__init__(extras, max_turns=max_turns, **settings)
        from omegaconf import OmegaConf

        gym = skyrl_gym_module(PREFIX + env_id)
        self.env_id = env_id
        self.inner = gym.make(env_id, env_config=OmegaConf.create(dict(settings)),
                              extras={**self.extras, "max_turns": self.max_turns})
        self._warned_postprocessed = False

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        return self.inner.init([dict(m) for m in prompt])   # checked by the generator

    def step(self, action: str) -> StepOutput:
        out = self.inner.step(action)
        if not isinstance(out, Mapping) or not {"observations", "reward", "done"} <= set(out):
            raise EnvOutputError("type", f"skyrl-gym env {self.env_id!r}: step returned {type(out).__name__} "
                                         f"{short_repr(out, 120)}, not a BaseTextEnvStepOutput (observations, "
                                         "reward, done, metadata). Fix: return BaseTextEnvStepOutput(...).")
        self.turns += 1
        metadata = out.get("metadata")
        if metadata is None:  # skyrl-gym's default; the generator reads None as no metadata too
            metadata = {}
        if out.get("postprocessed_action") is not None and isinstance(metadata, Mapping):
            metadata = {**metadata, "postprocessed_action": out["postprocessed_action"]}
            if not self._warned_postprocessed:
                self._warned_postprocessed = True
                log.warning("skyrl-gym env %r returned a postprocessed_action; Ridgeline keeps the sampled "
                            "tokens (token-in/token-out) and puts it in the step metadata only", self.env_id)
        # the values as skyrl-gym returned them: the generator checks each (not bool(done), which
        # would take the string "false" for True)
        return StepOutput(observations=out["observations"], reward=out["reward"], done=out["done"], metadata=metadata)

    def get_metrics(self) -> dict[str, Any]:
        return self.inner.get_metrics()   # as returned: the generator checks it is a dict

    def aggregate_metrics(self, episodes: list[dict[str, Any]]) -> dict[str, float]:
        """The env class's own ``aggregate_metrics`` (skyrl-gym's default averages numbers), as
        SkyRL's ``aggregate_for_environment`` calls it; numbers only are kept for logging."""
        combined = type(self.inner).aggregate_metrics(episodes) or {}
        if not isinstance(combined, Mapping):
            raise EnvOutputError("metrics", f"skyrl-gym env {self.env_id!r}: aggregate_metrics returned "
                                            f"{type(combined).__name__} {short_repr(combined)}, not a dict")
        return mean_of_numbers([combined])

    def close(self) -> None:
        self.inner.close()
