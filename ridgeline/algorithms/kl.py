"""Per-token estimators of KL(pi || ref) from log-probabilities of sampled tokens.

All estimators see log_ratio = log pi(y_t) - log ref(y_t) for tokens y_t drawn from
pi, and return a [B, T] tensor with no reduction; masking and averaging are the
caller's business. Math is done in float32 because bf16 log-probs lose most of
their precision once exponentiated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ridgeline.algorithms.registry import KL_ESTIMATORS, register_kl_estimator

# exp(20) ~ 4.9e8 still fits float32 comfortably; beyond it the estimate is noise anyway.
_LOG_RATIO_CLAMP = 20.0
# A single token whose k3 exceeds 10 nats would swamp the penalty of the whole batch.
_K3_CLAMP = 10.0


def _log_ratio(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return log_probs.float() - ref_log_probs.float()


@register_kl_estimator("k1")
def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k1 = log(pi / ref). Unbiased for KL(pi||ref) but high variance, and can be negative."""
    return _log_ratio(log_probs, ref_log_probs)


@register_kl_estimator("abs")
def kl_abs(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """|log(pi / ref)|. Biased, but non-negative."""
    return _log_ratio(log_probs, ref_log_probs).abs()


@register_kl_estimator("k2")
def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k2 = 1/2 (log(pi / ref))^2. Biased, low variance; its gradient is that of KL to second order."""
    return 0.5 * _log_ratio(log_probs, ref_log_probs).square()


@register_kl_estimator("k3")
def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k3 = ref/pi - 1 - log(ref/pi) = exp(-x) - 1 + x,  x = log(pi / ref).

    Schulman's estimator: unbiased for KL(pi||ref) under y ~ pi, always >= 0, low
    variance. For numerical safety x is clamped to [-20, 20] before use (exp(-x)
    would overflow float32 near x = -89) and the result to [-10, 10] so one
    runaway token cannot dominate the penalty. Both clamps zero the gradient of
    the tokens they bite on.
    """
    x = _log_ratio(log_probs, ref_log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(-x) - 1.0 + x).clamp(-_K3_CLAMP, _K3_CLAMP)


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate [B, T] using the estimator registered under `kind`."""
    return KL_ESTIMATORS.get(kind)(log_probs, ref_log_probs)


def resolve_kl_estimator(
    kl_estimator_type: str | None, use_kl_estimator_k3: bool, use_abs_kl: bool
) -> str:
    """Map the config's KL knobs to one estimator name.

    An explicit `kl_estimator_type` wins; otherwise the legacy booleans decide, with
    `use_abs_kl` taking precedence over `use_kl_estimator_k3`, and k1 as fallback.
    The name is validated here so a typo fails at start-up, not mid-training.
    """
    if kl_estimator_type:
        name = kl_estimator_type
    elif use_abs_kl:
        name = "abs"
    elif use_kl_estimator_k3:
        name = "k3"
    else:
        name = "k1"
    KL_ESTIMATORS.get(name)
    return name
