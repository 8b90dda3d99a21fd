"""Off-policy correction between the engine that sampled and the policy that trains.

The engine samples with its own numerics (bf16 weights, a different kernel, a KV cache), so the
"old" policy the trainer recomputes is not exactly the policy that produced the tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# exp(20) ~ 4.9e8: finite, and far above any sensible cap
_LOG_RATIO_CLAMP = 20.0


def truncated_importance_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"), per token:

        w_t = min( exp(log pi_old(y_t) - log pi_rollout(y_t)),  C )

    The policy-gradient term of each token is multiplied by w_t, correcting for the engine's
    distribution differing from the trainer's pi_old; the cap C bounds the variance. No gradient.
    """
    if cap <= 0:
        raise ValueError(f"tis_imp_ratio_cap must be > 0 when use_tis is on, got {cap}")
    with torch.no_grad():
        log_ratio = (old_log_probs.float() - rollout_log_probs.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return log_ratio.exp().clamp(max=cap)


def logprob_mismatch(trainer_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> tuple[float, float, float]:
    """(sum, max, count) of |trainer - rollout| logprob over masked tokens: summable across
    micro-batches, so the caller can report an exact mean and max per step."""
    with torch.no_grad():
        diff = (trainer_log_probs.float() - rollout_log_probs.float()).abs() * mask
        return float(diff.sum()), float(diff.max()) if diff.numel() else 0.0, float(mask.sum())


def prob_ratio_moments(trainer_log_probs: Tensor, rollout_log_probs: Tensor,
                       mask: Tensor) -> tuple[float, float, float]:
    """Summable moments of SkyRL's engine/trainer probability ratio over the masked tokens,

        q_t = exp(log pi_rollout(y_t) - log pi_old(y_t)),

    as (sum of d_t, sum of d_t^2, count) with d_t = q_t - 1: shifted by 1 (q_t sits near 1) so the
    variance `ratio_mean_std` recovers from the sums keeps its digits. float64, no clamp: a
    token the two disagree on wildly shows as a large ratio, as in SkyRL."""
    with torch.no_grad():
        picked = mask > 0
        # `where`, not indexing: no data-dependent shape on the device (and padding's garbage stays out)
        dev = torch.where(picked, (rollout_log_probs.double() - trainer_log_probs.double()).exp() - 1.0, 0.0)
        total, squares, count = torch.stack([dev.sum(), dev.square().sum(), picked.sum().double()]).tolist()
    return total, squares, count


def ratio_mean_std(dev_sum: float, dev_squares: float, count: float) -> tuple[float, float]:
    """(mean, unbiased std) of q_t from `prob_ratio_moments` sums (added over micro-batches and
    ranks): SkyRL's `policy/rollout_train_prob_diff_mean` / `_std` (torch's std: n - 1; NaN for
    one token)."""
    if count <= 0:
        raise ValueError("ratio_mean_std: no tokens")
    mean_dev = dev_sum / count
    if count < 2:
        return 1.0 + mean_dev, float("nan")
    variance = max(0.0, (dev_squares - dev_sum * mean_dev) / (count - 1))
    return 1.0 + mean_dev, math.sqrt(variance)
