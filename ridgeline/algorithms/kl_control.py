"""KL to the reference model folded into the reward (`use_kl_in_reward`), and its coefficient.

The alternative to a KL loss term (`use_kl_loss`): each response token's reward is lowered by
beta times its KL estimate, so the penalty flows through the advantage estimator like any other
reward. With the task reward dropped and a teacher as the reference, the same path is on-policy
distillation (`on_policy_distillation`). beta is held by a controller, either fixed or adapted towards a target KL (Ziegler et al.
2019, "Fine-Tuning Language Models from Human Preferences", arXiv 1909.08593).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ridgeline.algorithms.kl import kl_penalty
from ridgeline.algorithms.reductions import masked_mean


@dataclass
class FixedKLController:
    """beta stays at its initial value."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps


@dataclass
class AdaptiveKLController:
    """Proportional controller of Ziegler et al. (2019):

        e    = clip(KL_current / KL_target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    beta grows while the policy's KL sits above the target and shrinks below it; `horizon` (in
    samples) sets how fast: one step of n samples moves beta by at most 0.2 n / horizon.
    """

    value: float
    target: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"adaptive KL control needs kl_target > 0 and horizon > 0, "
                             f"got {self.target} and {self.horizon}")

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


def build_kl_controller(kind: str, init_coef: float, kl_target: float, horizon: int) -> KLController:
    """`trainer.algorithm.kl_ctrl.type` -> controller; `kl_loss_coef` is the initial beta."""
    if kind == "fixed":
        return FixedKLController(init_coef)
    if kind == "adaptive":
        return AdaptiveKLController(init_coef, kl_target, horizon)
    raise ValueError(f"unknown kl_ctrl.type {kind!r}; use fixed or adaptive")


@dataclass(frozen=True)
class KLPenalty:
    rewards: Tensor       # [B, T] r_t - beta * KL_t (or -beta * KL_t alone, keep_task_reward=False)
    kl_mean: float        # mean over rows of each row's masked mean KL_t: what the controller steers by
    kl_max_mean: float    # mean over rows of each row's max |KL_t| over its masked tokens
    kl_token_mean: float  # mean of KL_t over every masked token of the batch


def kl_penalized_rewards(token_level_rewards: Tensor, log_probs: Tensor, ref_log_probs: Tensor,
                         mask: Tensor, beta: float, kind: str = "k1", *,
                         keep_task_reward: bool = True) -> KLPenalty:
    """r'_t = r_t - beta * KL_t over the masked tokens, with KL_t the `kind` estimate of
    KL(pi_old || ref) at token t; all tensors [B, T]. `mask` is the loss mask (SkyRL's: no penalty
    on observation tokens, which the policy did not sample).

    keep_task_reward=False drops r_t: r'_t = -beta * KL_t is then the whole reward. With k1, beta 1
    and the teacher as `ref` that is on-policy distillation (Agarwal et al. 2024, arXiv 2306.13649;
    Thinking Machines 2025): r'_t = -(log pi_old(y_t) - log pi_teacher(y_t)), whose policy gradient
    on the student's own samples is that of the reverse KL(pi || pi_teacher).

    kl_mean and kl_max_mean are SkyRL's `loss/avg_kl` and `loss/avg_kl_max` (a row without masked
    tokens counts 0 in both); kl_token_mean weighs every masked token alike.
    """
    with torch.no_grad():
        kl = kl_penalty(log_probs, ref_log_probs, kind) * mask
        task = token_level_rewards.float() if keep_task_reward else torch.zeros_like(kl)
        rewards = task - beta * kl
        if not kl.numel():
            return KLPenalty(rewards, 0.0, 0.0, 0.0)
        stats = torch.stack([masked_mean(kl, mask, dim=-1).mean(), kl.abs().amax(dim=-1).mean(),
                             masked_mean(kl, mask)])
        kl_mean, kl_max_mean, kl_token_mean = stats.tolist()
    return KLPenalty(rewards, kl_mean, kl_max_mean, kl_token_mean)
