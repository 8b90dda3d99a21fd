"""Advantage estimators.

Every estimator has the same signature,

    fn(token_level_rewards [B, T], response_mask [B, T], uids: Sequence[str], **cfg)
        -> (advantages [B, T], returns [B, T])

and accepts (and ignores) keyword arguments meant for other estimators, so the
trainer can call whichever one the config names without special-casing it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from ridgeline.algorithms.registry import register_advantage_estimator


def _group_index(uids: Sequence[Hashable], device: torch.device) -> tuple[Tensor, int]:
    """Map each row's uid to a dense group id 0..G-1 (in order of first appearance)."""
    ids: dict[Hashable, int] = {}
    index = [ids.setdefault(uid, len(ids)) for uid in uids]
    return torch.tensor(index, dtype=torch.long, device=device), len(ids)


@register_advantage_estimator("grpo")
def compute_grpo_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    uids: Sequence[str],
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    **_ignored: Any,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantage (GRPO), one scalar per response.

    With r_i = sum_t R_{i,t} the score of response i and G(i) the responses sharing
    its prompt uid:

        A_i = (r_i - mean_{G(i)} r) / (std_{G(i)} r + epsilon)   if norm_by_std
        A_i =  r_i - mean_{G(i)} r                               otherwise (Dr. GRPO)

    std is the unbiased (Bessel, n - 1) sample std, matching torch.std. A group of
    one has no spread to compare against, so it is given mean 0 and std 1: its
    advantage is then its raw score (r_i / (1 + epsilon) when normalising). A_i is
    broadcast over the response tokens and zeroed on padding. returns = advantages,
    as there is no value baseline. Computed in float32 without grad.
    """
    batch = token_level_rewards.shape[0]
    if len(uids) != batch:
        raise ValueError(f"got {len(uids)} uids for a batch of {batch} responses")

    with torch.no_grad():
        scores = token_level_rewards.float().sum(-1)
        group, num_groups = _group_index(uids, scores.device)

        counts = torch.zeros(num_groups, device=scores.device).index_add_(
            0, group, torch.ones_like(scores)
        )
        mean = torch.zeros(num_groups, device=scores.device).index_add_(0, group, scores) / counts
        # Two-pass variance (as torch.std does) avoids the cancellation of E[x^2] - E[x]^2.
        sq_dev = (scores - mean[group]).square()
        sum_sq = torch.zeros(num_groups, device=scores.device).index_add_(0, group, sq_dev)
        singleton = counts < 2
        std = torch.where(singleton, torch.ones_like(counts), (sum_sq / (counts - 1).clamp(min=1)).sqrt())
        mean = torch.where(singleton, torch.zeros_like(mean), mean)

        centred = scores - mean[group]
        per_row = centred / (std[group] + epsilon) if norm_by_std else centred
        advantages = per_row.unsqueeze(-1) * response_mask.float()
    return advantages, advantages.clone()
