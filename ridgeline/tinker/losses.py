"""The Tinker SDK's built-in losses as Ridgeline's registered policy losses, with the SDK's
semantics: every loss is a SUM over the datum's positions (no mean), its per-token weights are the
loss mask, and the sampler's logprobs are pi_old.

    cross_entropy        -sum_t w_t log p_t                                  `sft`, mask = weights
    importance_sampling  -sum_t r_t A_t,  r_t = p_t / q_t                    `importance_sampling`
    ppo                  -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)          `regular`, eps = 1 - lo, hi - 1
    cispo                -sum_t sg(clip(r_t, lo, hi)) A_t log p_t            `cispo`
    dro                  -sum_t (A_t log p_t - beta/2 (log p_t - log q_t)^2) `dro` (registered here)

lo / hi are `clip_low_threshold` / `clip_high_threshold` of `loss_fn_config` (default 0.8 / 1.2),
beta is `beta` (default 0.05). The SDK's custom losses (`forward_backward_custom`) run in the
client and reach the server as `cross_entropy` with the loss's gradient as weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ridgeline.algorithms.calling import PolicyLoss
from ridgeline.config.loss_view import LossConfig, loss_config
from ridgeline.config.schema import AlgorithmConfig
from ridgeline.inference.request_fields import RequestError

SUM = "token_sum"   # the registered reduction (ridgeline.algorithms.reductions)


@dataclass(frozen=True)
class BuiltinLoss:
    registered: str                    # the POLICY_LOSSES name
    inputs: tuple[str, ...]            # loss_fn_inputs besides target_tokens
    options: dict[str, float]          # loss_fn_config keys and defaults


LOSSES: dict[str, BuiltinLoss] = {
    "cross_entropy": BuiltinLoss("sft", ("weights",), {}),
    "importance_sampling": BuiltinLoss("importance_sampling", ("logprobs", "advantages"), {}),
    "ppo": BuiltinLoss("regular", ("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": BuiltinLoss("cispo", ("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "dro": BuiltinLoss("dro", ("logprobs", "advantages"), {"beta": 0.05}),
}


@dataclass(frozen=True)
class BoundLoss:
    """A built-in loss with its options, ready for one datum's logprobs."""

    name: str
    loss: PolicyLoss
    config: LossConfig
    inputs: tuple[str, ...]

    def __call__(self, log_probs: Tensor, inputs: dict[str, Tensor]) -> Tensor:
        """log_probs [N] (with gradient) -> the datum's summed loss."""
        lp = log_probs[None]
        if self.name == "cross_entropy":
            mask, old, adv = inputs["weights"][None], torch.zeros_like(lp), torch.zeros_like(lp)
        else:
            mask, old, adv = torch.ones_like(lp), inputs["logprobs"][None], inputs["advantages"][None]
        loss, _ = self.loss(lp, old.to(lp.dtype), adv.to(lp.dtype), mask.to(lp.dtype), self.config)
        return loss


def bind(name: str, options: dict[str, float | str]) -> BoundLoss:
    """The loss `name` with `loss_fn_config` `options`; a name or an option not served is a 400."""
    builtin = LOSSES.get(name)
    if builtin is None:
        served = ", ".join(LOSSES)
        raise RequestError(f"loss_fn {name!r} is not served here (built-in losses: {served}; custom losses run "
                           "through forward_backward_custom)", "loss_fn")
    values = dict(builtin.options)
    for key, value in options.items():
        if key not in builtin.options:
            known = ", ".join(builtin.options) or "none"
            raise RequestError(f"loss_fn_config.{key}: {name} takes no such option (options: {known})",
                               f"loss_fn_config.{key}")
        if isinstance(value, str):
            raise RequestError(f"loss_fn_config.{key} must be a number, got {value!r}", f"loss_fn_config.{key}")
        values[key] = float(value)
    lo, hi = values.get("clip_low_threshold", 0.8), values.get("clip_high_threshold", 1.2)
    if not 0.0 <= lo <= 1.0 <= hi:
        raise RequestError(f"loss_fn_config: need 0 <= clip_low_threshold ({lo}) <= 1 <= clip_high_threshold ({hi})",
                           "loss_fn_config.clip_low_threshold")
    # every other key at trainer.algorithm's default (no off-policy correction, the old-policy anchor)
    default = AlgorithmConfig()
    algorithm = replace(default, loss_reduction=SUM, use_tis=False, eps_clip_low=1.0 - lo, eps_clip_high=hi - 1.0,
                        dro_beta=values.get("beta", 0.05),
                        cispo=replace(default.cispo, cispo_eps_clip_low=1.0 - lo, cispo_eps_clip_high=hi - 1.0))
    # a sum over the datum's positions: no max_seq_len constant to divide by
    return BoundLoss(name, PolicyLoss.bind(builtin.registered), loss_config(algorithm, max_seq_len=None),
                     builtin.inputs)
