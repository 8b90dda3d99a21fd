"""The step's metric formulas, pure functions of what the step produced.

SkyRL-Train 0.3.1's names carry SkyRL's formulas (skyrl_train/generators/utils.py
`get_rollout_metrics` and `get_metrics_from_generator_output`, skyrl_train/trainer.py
`compute_advantages_and_returns`), so a SkyRL dashboard reads the same numbers here; Ridgeline's
own names (`reward/accuracy`, `reward/solve_*_frac`, `generate/truncated_frac`) sit beside them.
docs/logging.md has the table of every name.

Two verdicts on a trajectory:
    passes   SkyRL's: its outcome reward is positive. For a per-token reward the outcome is the
             reward on the last token the policy sampled (the last loss-mask 1): SkyRL reads the
             last token, where its generator puts the final reward; Ridgeline's generator keeps
             that reward on the last sampled token, and a token appended after it (the eos of
             append_eos_token_after_stop_str_in_multi_turn, an observation) holds 0. Used by
             every `pass_at_*` metric.
    solved   Ridgeline's: its total reward is at least SOLVED_THRESHOLD (1.0), so partial credit
             (a format score) never counts. Used by the `accuracy` and `solve_*` metrics.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Sequence

import torch
from torch import Tensor

from ridgeline.generation.types import Reward, total_reward

SOLVED_THRESHOLD = 1.0


def outcome_reward(reward: Reward, loss_mask: Sequence[int]) -> float:
    """A trajectory's outcome: its reward, or for a per-token reward the entry on the last sampled
    token (the last 1 of `loss_mask`, aligned with it); 0.0 for one with no sampled token."""
    if not isinstance(reward, list):
        return float(reward)
    last = max((i for i, m in enumerate(loss_mask) if m), default=None)
    return float(reward[last]) if last is not None else 0.0


def passes(reward: Reward, loss_mask: Sequence[int]) -> bool:
    """SkyRL's pass: the outcome reward (`outcome_reward`) is > 0."""
    return outcome_reward(reward, loss_mask) > 0.0


def positive_reward(reward: Reward) -> float:
    """The reward with its negative parts dropped: max(r, 0), or the sum of max(r_t, 0)."""
    if isinstance(reward, list):
        return float(sum(max(r, 0.0) for r in reward))
    return max(float(reward), 0.0)


def pass_at_n(rewards: Sequence[Reward], loss_masks: Sequence[Sequence[int]], uids: Sequence[str]) -> float:
    """Share of prompts (uids) with at least one passing sample."""
    groups: dict[str, bool] = defaultdict(bool)
    for uid, reward, mask in zip(uids, rewards, loss_masks, strict=True):
        groups[uid] |= passes(reward, mask)
    return sum(groups.values()) / len(groups)


def reward_metrics(rewards: Sequence[Reward], loss_masks: Sequence[Sequence[int]], uids: Sequence[str],
                   n: int) -> dict[str, float]:
    """SkyRL's `reward/*` of the trajectories the step trains on (after the truncation rules and
    dynamic sampling), n samples per prompt (`loss_masks` locate a per-token reward's outcome):

        reward/avg_raw_reward        mean_i R_i                  (R_i the total reward)
        reward/avg_pass_at_<n>       share of prompts with a passing sample
        reward/mean_positive_reward  mean_i sum_t max(r_it, 0)
    """
    if not rewards:
        raise ValueError("reward_metrics: no trajectories")
    return {
        "reward/avg_raw_reward": statistics.fmean(total_reward(r) for r in rewards),
        f"reward/avg_pass_at_{n}": pass_at_n(rewards, loss_masks, uids),
        "reward/mean_positive_reward": statistics.fmean(positive_reward(r) for r in rewards),
    }


def rollout_metrics(rewards: Sequence[Reward], response_ids: Sequence[Sequence[int]], stop_reasons: Sequence[str],
                    uids: Sequence[str]) -> dict[str, float]:
    """What the policy sampled (the step's first generated batch, the environments' own rewards):
    SkyRL's `generate/*` token statistics over len(response_ids[i]) (observation tokens of
    multi-turn episodes included), and Ridgeline's solved-based `reward/*` and truncation share.

        generate/std_num_tokens               population std of the lengths (numpy's np.std)
        generate/avg_tokens_non_zero_rewards  mean length of samples with R_i > 0 (0 if none)
        generate/avg_tokens_zero_rewards      mean length of samples with R_i == 0 (0 if none)
    """
    totals = [total_reward(r) for r in rewards]
    lengths = [len(r) for r in response_ids]
    groups: dict[str, list[float]] = defaultdict(list)
    for uid, reward in zip(uids, totals, strict=True):
        groups[uid].append(reward)
    positive = [n for n, r in zip(lengths, totals) if r > 0.0]
    zero = [n for n, r in zip(lengths, totals) if r == 0.0]
    return {
        "reward/accuracy": sum(r >= SOLVED_THRESHOLD for r in totals) / len(totals),
        "reward/solve_none_frac": sum(max(v) < SOLVED_THRESHOLD for v in groups.values()) / len(groups),
        "reward/solve_all_frac": sum(min(v) >= SOLVED_THRESHOLD for v in groups.values()) / len(groups),
        "generate/avg_num_tokens": statistics.fmean(lengths),
        "generate/max_num_tokens": float(max(lengths)),
        "generate/min_num_tokens": float(min(lengths)),
        "generate/std_num_tokens": statistics.pstdev(lengths),
        "generate/avg_tokens_non_zero_rewards": statistics.fmean(positive) if positive else 0.0,
        "generate/avg_tokens_zero_rewards": statistics.fmean(zero) if zero else 0.0,
        "generate/truncated_frac": sum(s != "stop" for s in stop_reasons) / len(stop_reasons),
    }


def advantage_metrics(rewards: Tensor, advantages: Tensor, response_mask: Tensor) -> dict[str, float]:
    """SkyRL's `loss/*` of the advantage step, all [B, T] (before `advantage_batch_normalize`):

        loss/avg_final_rewards       mean_i sum_t r_it      (the rewards the estimator saw)
        loss/avg_raw_advantages      mean of A_it over the response tokens
        loss/avg_raw_advantages_abs  mean of |A_it| over the response tokens
    """
    with torch.no_grad():
        mask = response_mask.bool()
        picked = advantages.float()[mask]
        values = torch.stack([rewards.float().sum(-1).mean(), picked.mean(), picked.abs().mean()]).tolist()
    return dict(zip(("loss/avg_final_rewards", "loss/avg_raw_advantages", "loss/avg_raw_advantages_abs"), values))
