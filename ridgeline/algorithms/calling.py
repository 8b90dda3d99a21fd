"""Calling a registered policy loss, whether it was written for Ridgeline or for SkyRL-Train.

The two conventions differ in three places:

    Ridgeline  fn(log_probs, old_log_probs, advantages, loss_mask, config, rollout_log_probs=None)
                   -> (loss, metrics: dict[str, float])
    SkyRL      fn(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None)
                   -> (loss, clip_ratio: float)

so `PolicyLoss.bind(name)` reads the function's signature once and calls it the way it was
written: by keyword (`loss_mask=`, `config=`, the rollout logprobs under the name it declares)
when it names `loss_mask` or `config`, else positionally in Ridgeline's order; a number (or None)
in place of the metrics is SkyRL's clip ratio and becomes `{"clip_frac": value}`.

A loss that never calls `reduce_loss` (SkyRL's `reinforce` example returns `(-log_probs *
advantages).mean()`) cannot see the mini-batch normalisers, so its value is a micro-batch mean;
it is then divided by the number of micro-batches of the optimizer step, which is SkyRL's gradient
accumulation (`loss / accumulation_steps`, averaged over the ranks), and a warning says so once.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ridgeline.algorithms.reductions import current_normalizers
from ridgeline.algorithms.registry import POLICY_LOSSES

logger = logging.getLogger(__name__)

Metrics = dict[str, float]
_ROLLOUT_NAMES = ("rollout_log_probs", "rollout_logprobs")   # Ridgeline's spelling, SkyRL's


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss bound to its calling convention; call it as
    `loss(log_probs, old_log_probs, advantages, loss_mask, config, rollout_log_probs)`, all [B, T]."""

    name: str
    fn: Callable[..., Any]
    by_keyword: bool                 # SkyRL's order: loss_mask / config passed by name
    rollout_names: tuple[str, ...]   # the keyword(s) the rollout logprobs go under; () when not taken
    rollout_positional: bool         # Ridgeline's positional order with a sixth parameter

    @classmethod
    def bind(cls, name: str) -> "PolicyLoss":
        """The loss registered as `name` (or imported from `module:function`). TypeError when its
        signature fits neither convention."""
        fn = POLICY_LOSSES.get(name)
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature to read (a C callable): Ridgeline's call
            return cls(name, fn, False, (_ROLLOUT_NAMES[0],), False)
        params = sig.parameters
        kinds = [p.kind for p in params.values()]
        by_keyword = "loss_mask" in params or "config" in params
        # the rollout logprobs under the name the function declares; both names into a **kwargs
        rollout_names = tuple(n for n in _ROLLOUT_NAMES if n in params) or (
            _ROLLOUT_NAMES if inspect.Parameter.VAR_KEYWORD in kinds else ())
        positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                         for k in kinds)
        rollout_positional = not (by_keyword or rollout_names) and (
            positional >= 6 or inspect.Parameter.VAR_POSITIONAL in kinds)
        bound = cls(name, fn, by_keyword, rollout_names, rollout_positional)
        bound._check_signature(sig)
        return bound

    def _check_signature(self, sig: inspect.Signature) -> None:
        args, kwargs = self._arguments(*(object(),) * 6)
        try:
            sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"policy loss {self.name!r} cannot be called as (log_probs, old_log_probs, advantages, "
                            f"loss_mask, config[, rollout_log_probs]) nor as SkyRL's (log_probs, old_log_probs, "
                            f"advantages, config=, loss_mask=[, rollout_logprobs=]): {exc}") from None

    def _arguments(self, log_probs: Any, old_log_probs: Any, advantages: Any, loss_mask: Any, config: Any,
                   rollout_log_probs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs = {name: rollout_log_probs for name in self.rollout_names}
        if self.by_keyword:
            return (log_probs, old_log_probs, advantages), {"loss_mask": loss_mask, "config": config, **kwargs}
        args = (log_probs, old_log_probs, advantages, loss_mask, config)
        return (args + (rollout_log_probs,) if self.rollout_positional else args), kwargs

    def __call__(self, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: Any,
                 rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
        norms = current_normalizers()
        seen = norms.reductions if norms is not None else 0
        args, kwargs = self._arguments(log_probs, old_log_probs, advantages, loss_mask, config, rollout_log_probs)
        loss, extra = self.fn(*args, **kwargs)
        if norms is not None and norms.reductions == seen and norms.micro_batches > 1:
            # a micro-batch mean: the step's loss is their mean, as SkyRL accumulates it
            _warn_unreduced_once(self.name, norms.micro_batches)
            loss = loss / norms.micro_batches
        return loss, _metrics(extra)


def _metrics(extra: Any) -> Metrics:
    """A Ridgeline loss's metrics dict, or SkyRL's clip ratio (a number, a 0-d tensor, or None)."""
    if isinstance(extra, dict):
        return extra
    if extra is None:
        return {}
    return {"clip_frac": float(extra)}


@functools.lru_cache(maxsize=None)
def _warn_unreduced_once(name: str, micro_batches: int) -> None:
    logger.warning("policy loss %r does not call ridgeline.algorithms.reduce_loss, so it cannot see the mini-batch "
                   "normalisers: its value is taken as a micro-batch mean and divided by the %d micro-batches of "
                   "the optimizer step (SkyRL's gradient accumulation)", name, micro_batches)
