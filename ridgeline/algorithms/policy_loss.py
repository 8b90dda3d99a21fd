"""Policy-gradient surrogate losses.

Every loss has the same signature,

    fn(log_probs, old_log_probs, advantages, loss_mask, *, config, reduction)
        -> (scalar loss, metrics: dict[str, float])

where all tensors are [B, T] and `reduction(per_token_loss, loss_mask)` turns the
per-token loss into the scalar (the trainer binds its global normalisers into it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ridgeline.algorithms.reductions import masked_mean
from ridgeline.algorithms.registry import register_policy_loss

Reduction = Callable[[Tensor, Tensor], Tensor]

# exp(20) ~ 4.9e8: far outside any clip range, yet finite, so a garbage log-prob on a
# padding token cannot turn into inf and then into NaN through `inf * 0` in the mask.
_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class PolicyLossConfig:
    """Clip ranges of the PPO surrogate.

    eps_clip_low / eps_clip_high bound the ratio to [1 - low, 1 + high]; a larger
    high than low is DAPO's "clip-higher". clip_ratio_c is the dual-clip bound,
    used only by the "dual_clip" loss.
    """

    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    clip_ratio_c: float = 3.0

    def __post_init__(self) -> None:
        if self.eps_clip_low < 0 or self.eps_clip_high < 0:
            raise ValueError(
                f"clip ranges must be non-negative, got low={self.eps_clip_low}, high={self.eps_clip_high}"
            )


def _clipped_surrogate(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, dict[str, float]]:
    """Per-token PPO loss and its metrics; shared by the regular and dual-clip losses."""
    # float32: bf16 log-prob differences are too coarse to resolve a 0.2 clip range.
    log_ratio = log_probs.float() - old_log_probs.detach().float()
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    adv = advantages.detach().float()

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.eps_clip_low, 1.0 + config.eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)

    with torch.no_grad():
        metrics = {
            # Strict: on a tie both branches give the same loss and gradient, so nothing was clipped.
            "clip_frac": masked_mean((clipped > unclipped).float(), loss_mask).item(),
            # k1 estimate of KL(old || new) on the sampled tokens.
            "ppo_kl": masked_mean(-log_ratio, loss_mask).item(),
        }
    return per_token, metrics


@register_policy_loss("regular")
def ppo_clip_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    config: PolicyLossConfig = PolicyLossConfig(),
    reduction: Reduction,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate, with rho_t = exp(log pi(y_t) - log pi_old(y_t)):

        l_t = max( -A_t rho_t,  -A_t clip(rho_t, 1 - eps_low, 1 + eps_high) )
        L   = reduction(l, mask)

    Metrics: clip_frac (share of masked tokens where the clipped term is strictly
    larger, i.e. the token gets no gradient) and ppo_kl (masked mean of
    log pi_old - log pi).
    """
    per_token, metrics = _clipped_surrogate(log_probs, old_log_probs, advantages, loss_mask, config)
    return reduction(per_token, loss_mask), metrics


@register_policy_loss("dual_clip")
def dual_clip_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    config: PolicyLossConfig = PolicyLossConfig(),
    reduction: Reduction,
) -> tuple[Tensor, dict[str, float]]:
    """Dual-clip PPO (Ye et al., 2020): the regular surrogate l_t, further bounded for A_t < 0:

        l'_t = min( l_t, -A_t c )   if A_t < 0,   else l_t,      c = clip_ratio_c > 1

    For a negative advantage the regular loss grows without bound in rho_t, so a
    token the policy has drifted far towards can dominate the update; the bound
    caps it at rho_t = c. Metrics: those of "regular" plus dual_clip_frac (share of
    masked tokens where the bound was active).
    """
    if config.clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {config.clip_ratio_c}")
    per_token, metrics = _clipped_surrogate(log_probs, old_log_probs, advantages, loss_mask, config)

    adv = advantages.detach().float()
    bound = -adv * config.clip_ratio_c
    bounded = (adv < 0) & (bound < per_token.detach())
    with torch.no_grad():
        metrics["dual_clip_frac"] = masked_mean(bounded.float(), loss_mask).item()
    per_token = torch.where(bounded, bound, per_token)
    return reduction(per_token, loss_mask), metrics
