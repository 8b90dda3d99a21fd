"""The step's advantages and returns, computed per trajectory.

`compute_advantages` runs `trainer.algorithm.advantage_estimator` on the batch's trajectories
(`TrajectoryLayout`): with one sample per trajectory that is the batch itself; with step-wise
samples (`generator.step_wise_trajectories`) it is each trajectory's steps stitched together, and
every step gets the part of the result that sits on its own tokens. So step-wise training changes
which rows the policy trains on, never what a token's advantage is:

    grpo / rloo      the trajectory's group-relative scalar (groups: the prompt's uid) on every
                     token of every step, however long each step is
    gae              delta / lambda-returns through the trajectory's later turns (rewards on each
                     turn's last token, values from each step's own row: the same prefix the
                     critic would see in the whole trajectory); observation tokens, which are in
                     no step, are not in the chain
    reinforce++      return-to-go through the later turns, whitened over the batch's tokens

(SkyRL 0.3.1 instead runs the estimator on the last steps only and copies the last step's
token-level advantage row to every earlier step, which gives an earlier step's tokens beyond the
last step's length advantage 0, and the last step's per-token GAE values at the wrong positions.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging


from ridgeline.algorithms import ADVANTAGE_ESTIMATORS, count_singleton_groups, whiten_advantages
from ridgeline.algorithms.reward_shaping import RunningRewardStd
from ridgeline.trainer.metrics import advantage_metrics
from ridgeline.training.batch import TrainingBatch
from ridgeline.training.trajectory_layout import TrajectoryLayout

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import AlgorithmConfig

log = logging.getLogger(__name__)


def compute_advantages(batch: TrainingBatch, alg: AlgorithmConfig, reward_std: RunningRewardStd | None) -> dict[str, float]:
    """Set `batch.advantages` and `batch.returns` from `batch.rewards` (and `batch.values`) with the
    estimator `alg.advantage_estimator` names, per trajectory. `reward_std` (`normalize_reward`
    with a critic) is updated with the trajectories' returns and divides the rewards first.
    `advantage_batch_normalize` whitens afterwards over every response token of the batch.
    Returns SkyRL's `loss/*` metrics (over trajectories), `reward/running_std` and
    `advantages/singleton_groups`."""
    metrics: dict[str, float] = {}
    layout = TrajectoryLayout.of(batch)
    rewards = layout.gather(batch.rewards)
    if reward_std is not None:
        reward_std.update(rewards.sum(-1).tolist())
        rewards = reward_std.scale(rewards)
        batch.rewards = layout.scatter(rewards)
        metrics["reward/running_std"] = reward_std.std
    estimator = ADVANTAGE_ESTIMATORS.get(alg.advantage_estimator)
    # SkyRL's keyword arguments (config: the trainer.algorithm section), so an estimator written for
    # SkyRL runs unchanged
    advantages, returns = estimator(
        token_level_rewards=rewards, response_mask=layout.mask, index=layout.uids,
        values=layout.gather(batch.values) if batch.values is not None else None,
        grpo_norm_by_std=alg.grpo_norm_by_std, gamma=alg.gamma, lambd=alg.lambd, config=alg)
    metrics.update(advantage_metrics(rewards, advantages, layout.mask))
    batch.advantages, batch.returns = layout.scatter(advantages), layout.scatter(returns)
    if alg.advantage_batch_normalize:
        batch.advantages = whiten_advantages(batch.advantages, batch.response_mask)
    singletons = count_singleton_groups(layout.uids)
    if singletons:
        log.warning("%d prompt groups hold a single sample: their advantage is 0 "
                    "(generator.n_samples_per_prompt=1?)", singletons)
    metrics["advantages/singleton_groups"] = float(singletons)
    return metrics


__all__ = ["compute_advantages"]
