"""Off-policy correction between the engine that sampled and the policy that trains.

The engine samples with its own numerics (bf16 weights, a different kernel, a KV cache), so the
"old" policy the trainer recomputes is not exactly the policy that produced the tokens.
"""

from __future__ import annotations

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
