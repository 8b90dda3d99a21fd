"""Your own policy loss, registered by name: "reinforce".

The Ridgeline counterpart of SkyRL's custom_policy_loss main file. It keeps SkyRL's conventions,
which Ridgeline recognises: the signature (log_probs, old_log_probs, advantages, config=...,
loss_mask=...), a (loss, clip ratio) return, and registration with `POLICY_LOSSES.register(name, fn)`
(SkyRL's `PolicyLossRegistry.register`). The loss reduces through `reduce_loss`, so gradient
accumulation stays exact.

    ridgeline train "trainer.algorithm.algorithm_modules=[examples/custom_algorithms/custom_policy_loss.py]" \\
        trainer.algorithm.policy_loss_type=reinforce ...
"""

import torch

from ridgeline.algorithms import POLICY_LOSSES, reduce_loss


def reinforce_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, config,
                   loss_mask: torch.Tensor | None = None, **kwargs):
    """l_t = -A_t log pi(y_t): the plain policy gradient, no ratio and no clipping (old_log_probs is
    not used), reduced the way trainer.algorithm.loss_reduction says."""
    per_token = -advantages.detach() * log_probs
    return reduce_loss(per_token, loss_mask, config.loss_reduction), 0.0


POLICY_LOSSES.register("reinforce", reinforce_loss)
