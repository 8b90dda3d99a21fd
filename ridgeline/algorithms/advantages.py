"""Advantage estimators.

Every estimator is called with keyword arguments only,

    fn(token_level_rewards=[B, T], response_mask=[B, T], index=Sequence[Hashable],
       values=..., gamma=..., lambd=..., grpo_norm_by_std=..., epsilon=...)
        -> (advantages [B, T], returns [B, T])

where `index` holds one group id per row (responses to the same prompt share one).
Both outputs are float32, carry no grad and are zero outside `response_mask`. Each
estimator accepts (and ignores) keyword arguments meant for the others, so the
trainer can call whichever one the config names without special-casing it.

Grouping estimators (grpo, rloo) give a group of one sample advantage 0: there is
nothing to compare it against. `count_singleton_groups(index)` tells the caller how
many such groups a batch holds, so it can log and warn.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from ridgeline.algorithms.registry import register_advantage_estimator


def _as_list(index: Sequence[Hashable] | Any) -> list[Hashable]:
    # Tensors / numpy arrays: iterate plain Python scalars, not 0-d arrays (which hash by id).
    return index.tolist() if hasattr(index, "tolist") else list(index)


def count_singleton_groups(index: Sequence[Hashable] | Any) -> int:
    """Number of group ids in `index` that occur exactly once (these get advantage 0)."""
    return sum(1 for n in Counter(_as_list(index)).values() if n == 1)


def _group_stats(
    scores: Tensor, index: Sequence[Hashable] | Any
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row (group size, group mean, unbiased group std, singleton flag) of `scores` [B].

    For singletons the std is set to 1 (never used) so no division produces NaN.
    """
    ids = _as_list(index)
    if len(ids) != scores.shape[0]:
        raise ValueError(f"got {len(ids)} index entries for a batch of {scores.shape[0]} responses")
    dense: dict[Hashable, int] = {}
    group = torch.tensor([dense.setdefault(i, len(dense)) for i in ids], dtype=torch.long, device=scores.device)
    num_groups = len(dense)

    counts = torch.zeros(num_groups, device=scores.device).index_add_(0, group, torch.ones_like(scores))
    mean = torch.zeros(num_groups, device=scores.device).index_add_(0, group, scores) / counts
    # Two-pass variance (as torch.std does) avoids the cancellation of E[x^2] - E[x]^2.
    sum_sq = torch.zeros(num_groups, device=scores.device).index_add_(0, group, (scores - mean[group]).square())
    singleton = counts < 2
    std = torch.where(singleton, torch.ones_like(counts), (sum_sq / (counts - 1).clamp(min=1)).sqrt())
    return counts[group], mean[group], std[group], singleton[group]


def _masked_mean_std(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and unbiased (n - 1) std of x over the tokens where mask is 1, whole batch.

    With no masked token the mean is 0; with fewer than two the std is 0.
    """
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = ((x - mean).square() * mask).sum() / (n - 1).clamp(min=1)
    return mean, var.sqrt()


def whiten_advantages(advantages: Tensor, response_mask: Tensor, epsilon: float = 1e-6) -> Tensor:
    """Whiten over every masked token of the batch: (A - mean) / (std + epsilon) * mask.

    mean / std are the masked mean and masked unbiased (n - 1) std. Used for
    `advantage_batch_normalize` and by REINFORCE++. float32, no grad.
    """
    with torch.no_grad():
        x = advantages.float()
        mask = response_mask.float()
        mean, std = _masked_mean_std(x, mask)
        return (x - mean) / (std + epsilon) * mask


def _per_token(per_row: Tensor, singleton: Tensor, response_mask: Tensor) -> Tensor:
    """A group-relative scalar per row -> [B, T]: 0 for groups of one (no baseline to compare
    against), broadcast over the response tokens, zero outside the mask."""
    per_row = torch.where(singleton, torch.zeros_like(per_row), per_row)
    return per_row.unsqueeze(-1) * response_mask.float()


@register_advantage_estimator("grpo")
def compute_grpo_advantages(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Hashable],
    grpo_norm_by_std: bool = True,
    epsilon: float = 1e-6,
    **_ignored: Any,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantage (GRPO, Shao et al. 2024, DeepSeekMath), one scalar per response.

    With r_i = sum_t R_{i,t} the score of response i and G(i) the rows sharing its
    group id in `index`:

        A_i = (r_i - mean_{G(i)} r) / (std_{G(i)} r + epsilon)   if grpo_norm_by_std
        A_i =  r_i - mean_{G(i)} r                               otherwise (Dr. GRPO)

    std is the unbiased (n - 1) sample std, as torch.std. A group of one gets A_i = 0
    (see `count_singleton_groups`). A_i is broadcast over the response tokens and
    zeroed outside the mask. returns = advantages (no value baseline).
    """
    with torch.no_grad():
        scores = token_level_rewards.float().sum(-1)
        _, mean, std, singleton = _group_stats(scores, index)
        centred = scores - mean
        per_row = centred / (std + epsilon) if grpo_norm_by_std else centred
        advantages = _per_token(per_row, singleton, response_mask)
    return advantages, advantages.clone()


@register_advantage_estimator("rloo")
def compute_rloo_advantages(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Hashable],
    **_ignored: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (RLOO, Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE-style Optimization for Learning from Human Feedback in LLMs").

    With r_i = sum_t R_{i,t} and a group G(i) of n >= 2 rows, the baseline is the mean
    of the other n - 1 scores:

        A_i = r_i - mean_{j in G(i), j != i} r_j = (r_i - mean_{G(i)} r) * n / (n - 1)

    A group of one gets A_i = 0. A_i is broadcast over the response tokens and zeroed
    outside the mask. returns = advantages.
    """
    with torch.no_grad():
        scores = token_level_rewards.float().sum(-1)
        counts, mean, _, singleton = _group_stats(scores, index)
        per_row = (scores - mean) * counts / (counts - 1).clamp(min=1)
        advantages = _per_token(per_row, singleton, response_mask)
    return advantages, advantages.clone()


@register_advantage_estimator("maxrl")
def compute_maxrl_advantages(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    **_ignored: Any,
) -> tuple[Tensor, Tensor]:
    """MaxRL (SkyRL 0.4's `maxrl`): the group-relative reward divided by the group's mean instead of
    its standard deviation,

        A_i = (r_i - mean_{G(i)} r) / (mean_{G(i)} r + epsilon)

    For 0/1 rewards with success rate p in the group this is 1/p - 1 for a success and -1 for a
    failure: rare successes weigh much more (the gradient of log p, maximum likelihood of success,
    rather than of p). Rewards are expected non-negative (a group mean near 0 from mixed signs
    blows up). A group of one gets A_i = 0, as in grpo (SkyRL's gives it r_i). A_i is broadcast
    over the response tokens, zero outside the mask; returns = advantages.
    """
    with torch.no_grad():
        scores = token_level_rewards.float().sum(-1)
        _, mean, _, singleton = _group_stats(scores, index)
        per_row = (scores - mean) / (mean + epsilon)
        advantages = _per_token(per_row, singleton, response_mask)
    return advantages, advantages.clone()


@register_advantage_estimator("reinforce++")
def compute_reinforce_plus_plus_advantages(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    epsilon: float = 1e-6,
    **_ignored: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models"): discounted return-to-go, whitened over the batch.

        G_t = m_t * (R_t + gamma * G_{t+1}),   G_T = 0          (right to left)
        A   = (G - mean_m G) / (std_m G + epsilon) * m

    m is response_mask; rewards outside it count as 0 and G is reset to 0 at every
    masked-out token, so no return flows across padding. mean_m / std_m are the masked
    mean and unbiased std over all masked tokens of the batch (see `whiten_advantages`).
    No grouping: `index` is accepted and ignored. returns = G * m (before whitening).
    """
    with torch.no_grad():
        rewards = token_level_rewards.float()
        mask = response_mask.float()
        returns = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[1])):
            running = (rewards[:, t] + gamma * running) * mask[:, t]
            returns[:, t] = running
        advantages = whiten_advantages(returns, mask, epsilon=epsilon)
    return advantages, returns


@register_advantage_estimator("gae")
def compute_gae_advantages(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    epsilon: float = 1e-6,
    **_ignored: Any,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (GAE, Schulman et al. 2016, "High-Dimensional
    Continuous Control Using Generalized Advantage Estimation", arXiv:1506.02438).

    With m the response mask, r = R * m and V = values * m (so right padding contributes
    nothing), and V_T = A_T = 0 past the last column, right to left:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = m_t * (delta_t + gamma * lambd * A_{t+1})
        returns = A + V                                  (the critic's regression target)
        A      <- (A - mean_m A) / (std_m A + epsilon) * m   (see `whiten_advantages`)

    A response's masked tokens are contiguous from column 0, so V_{t+1} at its last token is a
    padding column (0): the episode ends there. `returns` is taken before whitening. `values`
    are the critic's estimates V(s_t) of the state before token t; no grouping (`index` is
    ignored).
    """
    if values is None:
        raise ValueError("the gae advantage estimator needs critic values: set trainer.critic.model.path "
                         "so a critic is built (or pick grpo / rloo / reinforce++)")
    with torch.no_grad():
        mask = response_mask.float()
        rewards = token_level_rewards.float() * mask
        v = values.detach().float() * mask
        advantages = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        next_value = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + gamma * next_value - v[:, t]
            running = (delta + gamma * lambd * running) * mask[:, t]
            advantages[:, t] = running
            next_value = v[:, t]
        returns = (advantages + v) * mask
        advantages = whiten_advantages(advantages, mask, epsilon=epsilon)
    return advantages, returns


@register_advantage_estimator("no_op")
def compute_no_op_advantages(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    **_ignored: Any,
) -> tuple[Tensor, Tensor]:
    """The token rewards as they are (SkyRL's on-policy distillation example):

        A_t = R_t * m_t,   returns = A

    For dense per-token rewards that already are the advantage, such as on-policy distillation's
    -(log pi_old(y_t) - log pi_teacher(y_t)) (`trainer.algorithm.on_policy_distillation`). No
    baseline, no grouping, no whitening: `index` and `values` are ignored.
    """
    with torch.no_grad():
        advantages = token_level_rewards.float() * response_mask.float()
    return advantages, advantages.clone()
