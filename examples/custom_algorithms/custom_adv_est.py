"""Your own advantage estimator, registered by name: "simple_baseline".

The Ridgeline counterpart of SkyRL's custom_advantage_estimator main file. It is written the SkyRL
way (keyword arguments token_level_rewards, response_mask, index, ...; a (advantages, returns) pair),
which Ridgeline calls unchanged. No entry point of its own: name this file in the config and
Ridgeline imports it before it checks the estimator's name,

    ridgeline train "trainer.algorithm.algorithm_modules=[examples/custom_algorithms/custom_adv_est.py]" \\
        trainer.algorithm.advantage_estimator=simple_baseline ...
"""

import torch

from ridgeline.algorithms import register_advantage_estimator


@register_advantage_estimator("simple_baseline")
def batch_mean_baseline(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, **kwargs):
    """A_i = r_i - mean_j r_j on every token of response i, r_i its summed reward: one baseline
    for the whole batch (GRPO's is per prompt group, `index`, which this one ignores)."""
    with torch.no_grad():
        scores = (token_level_rewards * response_mask).sum(-1)            # [B]
        advantages = (scores - scores.mean()).unsqueeze(-1) * response_mask
    return advantages, advantages.clone()
