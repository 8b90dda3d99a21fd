"""KL in the reward and its controllers, DAPO's overlong punishment and dynamic sampling, reward
scaling for the critic: each against numbers worked out by hand."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ridgeline.algorithms.kl_control import (AdaptiveKLController, FixedKLController, build_kl_controller,
                                             kl_penalized_rewards)
from ridgeline.algorithms.reward_shaping import RunningRewardStd, soft_overlong_punishment
from ridgeline.generation.types import GeneratorOutput, TrajectoryID
from ridgeline.trainer.dynamic_sampling import (filter_rollout, first_groups, mask_signal_less_groups, num_groups,
                                               replace_rollout, signal_groups)


# ------------------------------------------------------------------------------ KL controllers
def test_fixed_controller_never_moves() -> None:
    ctl = build_kl_controller("fixed", 0.05, kl_target=0.1, horizon=100)
    assert isinstance(ctl, FixedKLController)
    ctl.update(current_kl=5.0, n_steps=64)
    assert ctl.value == 0.05


def test_adaptive_controller_by_hand() -> None:
    ctl = build_kl_controller("adaptive", 0.1, kl_target=0.1, horizon=1000)
    assert isinstance(ctl, AdaptiveKLController)
    # KL 0.15 vs target 0.1: e = 0.15/0.1 - 1 = 0.5 -> clipped to 0.2; beta *= 1 + 0.2 * 100/1000 = 1.02
    ctl.update(current_kl=0.15, n_steps=100)
    assert ctl.value == pytest.approx(0.102)
    # KL 0.09: e = -0.1; beta *= 1 - 0.1 * 500/1000 = 0.95 -> 0.102 * 0.95 = 0.0969
    ctl.update(current_kl=0.09, n_steps=500)
    assert ctl.value == pytest.approx(0.0969)


def test_adaptive_controller_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="kl_target > 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="fixed or adaptive"):
        build_kl_controller("pid", 0.1, 0.1, 10)


def test_kl_penalized_rewards_by_hand() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 7.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.8, -1.2, 0.0]])
    # k1 = old - ref: row 0 [0.5, -1.0, 0.0]; row 1 [-0.2, 0.2, (masked)]
    # beta = 0.1: row 0 rewards [-0.05, 0.1, 1.0]; row 1 [0.02, 0.48, 0]
    penalty = kl_penalized_rewards(rewards, old, ref, mask, beta=0.1, kind="k1")
    assert torch.allclose(penalty.rewards, torch.tensor([[-0.05, 0.1, 1.0], [0.02, 0.48, 0.0]]), atol=1e-6)
    # row means: (0.5 - 1.0 + 0) / 3 = -1/6; (-0.2 + 0.2) / 2 = 0 -> batch KL -1/12 (loss/avg_kl)
    assert penalty.kl_mean == pytest.approx(-1 / 12, abs=1e-6)
    # row max |KL|: 1.0; 0.2 (the masked 7.0 does not count) -> mean 0.6 (loss/avg_kl_max)
    assert penalty.kl_max_mean == pytest.approx(0.6, abs=1e-6)


def test_kl_penalized_rewards_k3_is_nonnegative() -> None:
    rewards = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    old, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -1.0]])
    # k3(x) = exp(-x) - 1 + x with x = old - ref = [1, -1]: [e^-1, e - 2] = [0.36788, 0.71828]
    penalty = kl_penalized_rewards(rewards, old, ref, mask, beta=1.0, kind="k3")
    assert torch.allclose(penalty.rewards, -torch.tensor([[math.exp(-1), math.e - 2]]), atol=1e-6)
    assert penalty.kl_mean == pytest.approx((math.exp(-1) + math.e - 2) / 2, abs=1e-6)
    assert penalty.kl_max_mean == pytest.approx(math.e - 2, abs=1e-6)


# ------------------------------------------------------------------------------ overlong punishment
def test_soft_overlong_punishment_by_hand() -> None:
    # L_max 16, buffer 4: free up to 12; 14 -> (12 - 14) / 4 = -0.5; 16 -> -1; x factor 2
    assert soft_overlong_punishment([3, 12, 13, 14, 16], 16, 4, 1.0) == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert soft_overlong_punishment([14, 17], 16, 4, 2.0) == [-1.0, -2.0]


@pytest.mark.parametrize("buffer", [0, 17])
def test_soft_overlong_punishment_checks_buffer(buffer: int) -> None:
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        soft_overlong_punishment([1], 16, buffer, 1.0)


# ------------------------------------------------------------------------------ reward scaling
def test_running_reward_std_merges_batches_exactly() -> None:
    stat = RunningRewardStd()
    stat.update([0.0, 1.0])
    # mean 0.5, population variance 0.25
    assert stat.std == pytest.approx(0.5)
    stat.update([1.0, 1.0, 2.0])
    # all five: [0, 1, 1, 1, 2], mean 1, squared deviations 1 + 0 + 0 + 0 + 1 = 2 -> var 0.4
    assert stat.mean == pytest.approx(1.0)
    assert stat.std == pytest.approx(math.sqrt(0.4))
    scaled = stat.scale(torch.tensor([[0.0, 2.0]]))
    assert torch.allclose(scaled, torch.tensor([[0.0, 2.0 / math.sqrt(0.4)]]))


def test_running_reward_std_leaves_constant_rewards_alone() -> None:
    stat = RunningRewardStd()
    stat.update([1.0, 1.0, 1.0])
    assert stat.std == 0.0
    rewards = torch.tensor([[0.0, 1.0]])
    assert stat.scale(rewards) is rewards


# ------------------------------------------------------------------------------ dynamic sampling
def _rollout(groups: dict[str, list[float]]) -> GeneratorOutput:
    ids = [TrajectoryID(uid, k) for uid, rewards in groups.items() for k in range(len(rewards))]
    rewards = [r for rs in groups.values() for r in rs]
    k = len(rewards)
    return GeneratorOutput(prompt_token_ids=[[i] for i in range(k)], response_ids=[[100 + i] for i in range(k)],
                           rewards=rewards, loss_masks=[[1]] * k, stop_reasons=["stop"] * k,
                           rollout_logprobs=[[-0.1]] * k, responses=[f"r{i}" for i in range(k)], trajectory_ids=ids,
                           metrics={"generate/env_errors": 1.0})


def test_signal_groups() -> None:
    uids = ["a", "a", "b", "b", "c", "d", "d"]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.25]
    # a differs, b all equal, c is a singleton (nothing to compare), d differs
    assert signal_groups(uids, rewards) == ["a", "d"]


def test_zero_variance_filter_masks_the_rows_of_signal_less_groups() -> None:
    """SkyRL's zero_variance_filter: groups whose rewards are all equal lose their loss masks; a
    singleton keeps its own (SkyRL keeps singletons); rewards and rows stay."""
    rollout = _rollout({"a": [1.0, 1.0], "b": [0.0, 1.0], "c": [0.5], "d": [0.0, 0.0, 0.0]})
    rollout.loss_masks = [[1, 1], [1, 0], [1, 1], [1, 1], [1], [1, 1, 1], [0, 1], [1]]
    assert mask_signal_less_groups(rollout) == 5
    assert rollout.loss_masks == [[0, 0], [0, 0], [1, 1], [1, 1], [1], [0, 0, 0], [0, 0], [0]]
    assert rollout.rewards == [1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0]


def test_filter_keeps_whole_signal_groups_in_order() -> None:
    rollout = _rollout({"a": [1.0, 1.0], "b": [0.0, 1.0], "c": [0.0, 0.0], "d": [0.5, 0.0]})
    kept = filter_rollout(rollout)
    assert kept.uids == ["b", "b", "d", "d"]
    assert kept.trajectory_ids == [TrajectoryID("b", 0), TrajectoryID("b", 1), TrajectoryID("d", 0), TrajectoryID("d", 1)]
    assert kept.rewards == [0.0, 1.0, 0.5, 0.0]
    assert kept.response_ids == [[102], [103], [106], [107]]
    assert first_groups(kept, 1).uids == ["b", "b"]


def test_concat_sums_metrics() -> None:
    both = GeneratorOutput.concat([_rollout({"a": [1.0, 0.0]}), _rollout({"b": [0.0, 1.0]})])
    assert both.uids == ["a", "a", "b", "b"] and num_groups(both) == 2
    assert both.metrics["generate/env_errors"] == 2.0
    assert len(both) == 4


def test_replace_copies_signal_groups_under_fresh_ids() -> None:
    rollout = _rollout({"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [0.0, 1.0], "d": [0.0, 0.0]})
    replaced, copies = replace_rollout(rollout, min_replace_ratio=0.5, rng=random.Random(0))
    assert copies == 2
    assert num_groups(replaced) == 4 and len(replaced) == 8
    assert replaced.uids[:2] == ["a", "a"] and replaced.uids[4:6] == ["c", "c"]
    for position in (2, 6):  # b and d became copies of a or c, with their rewards
        uid = replaced.uids[position]
        source = uid.split("#copy")[0]
        assert "#copy" in uid and source in {"a", "c"} and replaced.uids[position + 1] == uid
        assert [t.repetition for t in replaced.trajectory_ids[position:position + 2]] == [0, 1]
        assert replaced.rewards[position:position + 2] == rollout.rewards[
            rollout.uids.index(source):rollout.uids.index(source) + 2]
    assert rollout.uids == ["a", "a", "b", "b", "c", "c", "d", "d"]  # the input is left as it is


def test_replace_leaves_batch_when_too_few_groups_have_signal() -> None:
    rollout = _rollout({"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [0.0, 0.0], "d": [0.0, 0.0]})
    # 1 of 4 groups has signal: 0.25 < 0.3
    replaced, copies = replace_rollout(rollout, min_replace_ratio=0.3, rng=random.Random(0))
    assert copies == 0 and replaced is rollout
