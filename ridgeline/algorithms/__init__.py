"""RL objective building blocks: advantage estimators, policy losses, KL estimators, reductions.

Pure tensor functions looked up by name in registries. Importing this package
registers every built-in.
"""

from ridgeline.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_REDUCTIONS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
    register_advantage_estimator,
    register_kl_estimator,
    register_loss_reduction,
    register_policy_loss,
    load_algorithm_modules,
)

# Importing the modules below runs their @register decorators.
from ridgeline.algorithms.reductions import (
    LossNormalizers,
    current_normalizers,
    loss_normalizers,
    masked_mean,
    prompt_mean,
    reduce_loss,
    seq_mean_token_sum_norm,
    sequence_mean,
    token_mean,
    token_mean_legacy,
)
from ridgeline.algorithms.advantages import (
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_maxrl_advantages,
    compute_no_op_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_rloo_advantages,
    count_singleton_groups,
    whiten_advantages,
)
from ridgeline.algorithms.kl import kl_penalty, resolve_kl_estimator
from ridgeline.algorithms.value_loss import value_loss
from ridgeline.algorithms.calling import PolicyLoss
from ridgeline.algorithms.policy_loss import (
    cispo_loss,
    clip_cov_loss,
    dppo_loss,
    dual_clip_loss,
    gspo_loss,
    importance_sampling_loss,
    kl_cov_loss,
    ppo_clip_loss,
    rollout_is_loss,
    sapo_loss,
)
from ridgeline.algorithms.supervised import PREFERENCE_LOSSES, dpo_loss, preference_metrics, preference_sums, sft_loss

__all__ = [
    "LossNormalizers",
    "PolicyLoss",
    "current_normalizers",
    "loss_normalizers",
    "reduce_loss",
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_REDUCTIONS",
    "POLICY_LOSSES",
    "Registry",
    "UnknownNameError",
    "cispo_loss",
    "clip_cov_loss",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_maxrl_advantages",
    "compute_no_op_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_rloo_advantages",
    "count_singleton_groups",
    "dppo_loss",
    "dual_clip_loss",
    "gspo_loss",
    "importance_sampling_loss",
    "kl_cov_loss",
    "kl_penalty",
    "load_algorithm_modules",
    "masked_mean",
    "ppo_clip_loss",
    "prompt_mean",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_loss_reduction",
    "register_policy_loss",
    "resolve_kl_estimator",
    "rollout_is_loss",
    "sapo_loss",
    "PREFERENCE_LOSSES",
    "dpo_loss",
    "preference_metrics",
    "preference_sums",
    "sft_loss",
    "seq_mean_token_sum_norm",
    "sequence_mean",
    "token_mean",
    "token_mean_legacy",
    "value_loss",
    "whiten_advantages",
]
