"""SkyRL-Train 0.3.1's metric names (issue 18, item 6): every name SkyRL logs is logged by a tiny
run here, and the formulas behind the names new to Ridgeline give exact numbers on hand-made
inputs. docs/logging.md has the table (name, where SkyRL computes it, formula)."""

import math

import pytest
import torch

from ridgeline.algorithms.off_policy import prob_ratio_moments, ratio_mean_std
from ridgeline.config import load_config
from ridgeline.entrypoints.run import run_training
from ridgeline.generation.generator import ClassMetrics, environment_metrics
from ridgeline.tracking.trackers import read_metrics
from ridgeline.trainer.metrics import (advantage_metrics, passes, positive_reward, reward_metrics,
                                       rollout_metrics)

# Every name SkyRL-Train 0.3.1 logs, with where it computes it (paths in the skyrl_train wheel).
# `<n>` is generator.n_samples_per_prompt (8 in the tiny preset); eval's is
# generator.eval_n_samples_per_prompt (1); `<source>` is the rows' data_source ("arithmetic").
SKYRL_NAMES = [
    # trainer.py RayPPOTrainer.train, "8. set logs"
    "trainer/epoch", "trainer/global_step",
    # trainer.py postprocess_generator_output <- generators/utils.py get_metrics_from_generator_output
    "reward/avg_pass_at_8", "reward/avg_raw_reward", "reward/mean_positive_reward",
    # generators/utils.py get_rollout_metrics (the generator's rollout_metrics)
    "generate/min_num_tokens", "generate/max_num_tokens", "generate/avg_num_tokens", "generate/std_num_tokens",
    "generate/avg_tokens_non_zero_rewards", "generate/avg_tokens_zero_rewards",
    # trainer.py compute_advantages_and_returns
    "loss/avg_final_rewards", "loss/avg_raw_advantages", "loss/avg_raw_advantages_abs",
    # trainer.py apply_reward_kl_penalty (use_kl_in_reward)
    "loss/avg_kl", "loss/avg_kl_max", "loss/kl_loss_coef",
    # trainer.py fwd_logprobs_values_reward (engine logprobs)
    "policy/rollout_train_prob_diff_mean", "policy/rollout_train_prob_diff_std",
    # workers/worker.py PolicyWorkerBase.forward_backward / ppo_train, as "policy/<key>" by
    # trainer.py train_critic_and_policy (policy_kl with use_kl_loss)
    "policy/final_loss", "policy/policy_loss", "policy/ppo_clip_ratio", "policy/policy_entropy", "policy/policy_kl",
    "policy/raw_grad_norm", "policy/policy_lr", "policy/policy_update_steps",
    # workers/worker.py CriticWorkerBase.forward_backward / ppo_train, as "critic/<key>"
    "critic/critic_loss", "critic/values_mean", "critic/values_clipfrac", "critic/raw_grad_norm",
    "critic/critic_lr", "critic/critic_update_steps",
    # utils/trainer_utils.py calculate_per_dataset_metrics and evaluate.py evaluate
    "eval/arithmetic/avg_score", "eval/arithmetic/pass_at_1", "eval/arithmetic/mean_positive_reward",
    "eval/all/avg_score", "eval/all/pass_at_1", "eval/all/mean_positive_reward",
    # trainer.py train: Timer(name, self.all_timings), logged as "timing/<name>"
    "timing/step", "timing/generate", "timing/postprocess_generator_output", "timing/convert_to_training_input",
    "timing/fwd_logprobs_values_reward", "timing/apply_reward_kl_penalty", "timing/compute_advantages_and_returns",
    "timing/train_critic_and_policy", "timing/save_checkpoints", "timing/save_hf_model",
    "timing/update_ref_with_policy", "timing/sync_weights", "timing/eval",
    # trainer.py train_critic_and_policy (colocate_all) and save_checkpoints
    "timing/critic_train", "timing/policy_train", "timing/cleanup_old_checkpoints",
]
# Not in the list: SkyRL's `environment/<key>` (an env's own get_metrics keys; the arithmetic env
# has none: tests/test_multi_turn.py and tests/test_examples.py check them) and
# `timing/policy_critic_overlap_train` (SkyRL overlaps the critic's and the policy's updates when
# they do not share GPUs; Ridgeline always trains the critic first, so docs/logging.md lists it
# as not logged).


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny runs of two steps, between them every SkyRL name: GRPO with a KL loss (the tiny
    preset), and PPO with a critic, KL in the reward, two epochs (the reference refresh),
    checkpoints and exports at every step."""
    grpo, ppo = tmp_path_factory.mktemp("grpo"), tmp_path_factory.mktemp("ppo")
    run_training(load_config(["+experiment=tiny", f"trainer.export_path={grpo}", "data.prepare.num_train=32"]))
    run_training(load_config([
        "+experiment=tiny", f"trainer.export_path={ppo}", "data.prepare.num_train=16", "trainer.epochs=2",
        "trainer.algorithm.advantage_estimator=gae", "trainer.critic.model.path=tiny://llama",
        "trainer.critic_mini_batch_size=8", "trainer.algorithm.use_kl_loss=false",
        "trainer.algorithm.use_kl_in_reward=true", "trainer.update_ref_every_epoch=true",
        "trainer.ckpt_interval=1", "trainer.max_ckpts_to_keep=1", "trainer.hf_save_interval=1"]))
    return read_metrics(grpo / "tiny" / "metrics.jsonl"), read_metrics(ppo / "tiny" / "metrics.jsonl")


def test_every_skyrl_name_is_logged(runs):
    logged = {key for rows in runs for row in rows for key, value in row.items() if value is not None}
    assert [name for name in SKYRL_NAMES if name not in logged] == []


def test_every_training_step_row_carries_the_step_and_epoch(runs):
    grpo, ppo = runs
    for rows, epochs in ((grpo, [0.0, 0.0]), (ppo, [0.0, 1.0])):
        steps = [r for r in rows if "policy/policy_loss" in r]
        assert [r["trainer/global_step"] for r in steps] == [1.0, 2.0]
        assert [r["trainer/epoch"] for r in steps] == epochs
        assert all(r["policy/policy_update_steps"] == 1.0 for r in steps)
    # the work after a step (reference refresh, export, checkpoint) gets a row of its own
    after = [r for r in ppo if "timing/save_checkpoints" in r]
    assert [r["step"] for r in after] == [1, 2]
    assert "timing/update_ref_with_policy" in after[0] and "timing/update_ref_with_policy" not in after[1]
    assert all(r["timing/cleanup_old_checkpoints"] <= r["timing/save_checkpoints"] for r in after)


def test_removed_names_are_gone(runs):
    """Ridgeline's names for numbers SkyRL logs under its own (docs/logging.md, "Renamed")."""
    logged = {key for rows in runs for row in rows for key in row}
    old = {"policy/grad_norm", "policy/optimizer_steps", "policy/kl_loss", "critic/grad_norm", "critic/lr",
           "critic/optimizer_steps", "critic/vf_clip_frac", "advantages/mean", "reward/kl_in_reward",
           "reward/kl_coef", "timing/logprobs", "timing/advantages"}
    assert logged & old == set()


# ------------------------------------------------------------------------------------ formulas
def test_pass_is_a_positive_outcome_read_on_the_last_sampled_token():
    assert passes(0.5, [1]) and not passes(0.0, [1]) and not passes(-1.0, [1])
    assert passes([-1.0, 0.5], [1, 1]) and not passes([1.0, 0.0], [1, 1]) and not passes([], [])
    # a multi-turn episode whose last turn scored 1.0 on its last sampled token, followed by an
    # appended eos (append_eos_token_after_stop_str_in_multi_turn) or an observation: loss mask 0
    assert passes([0.0, 1.0, 0.0], [1, 1, 0]) and passes([0.0, 0.0, 1.0, 0.0, 0.0], [1, 0, 1, 0, 0])
    assert not passes([1.0, 0.0, 0.0, 0.0], [1, 0, 1, 0])  # an earlier turn's reward is not the outcome
    assert positive_reward(-2.0) == 0.0 and positive_reward(0.5) == 0.5
    assert positive_reward([-1.0, 0.5, 2.0]) == 2.5


def test_reward_metrics_by_hand():
    # prompt a: 1.0 and -0.5 (one passes); prompt b: 0.0 and -1.0 (none does)
    m = reward_metrics([1.0, -0.5, 0.0, -1.0], [[1]] * 4, ["a", "a", "b", "b"], n=2)
    assert m == {"reward/avg_raw_reward": pytest.approx(-0.5 / 4), "reward/avg_pass_at_2": 0.5,
                 "reward/mean_positive_reward": pytest.approx(1.0 / 4)}
    # per-token rewards: totals 1.0 and 0.5; the second's last sampled token holds 0, so it does not pass
    m = reward_metrics([[0.0, 1.0], [0.5, 0.0]], [[1, 1], [1, 1]], ["a", "b"], n=1)
    assert m == {"reward/avg_raw_reward": pytest.approx(0.75), "reward/avg_pass_at_1": 0.5,
                 "reward/mean_positive_reward": pytest.approx(0.75)}


def test_rollout_token_statistics_by_hand():
    # lengths 2, 4, 6, 8: mean 5, population std sqrt((9 + 1 + 1 + 9) / 4) = sqrt(5)
    m = rollout_metrics([1.0, 0.0, -1.0, 0.0], [[0] * 2, [0] * 4, [0] * 6, [0] * 8], ["stop"] * 3 + ["length"],
                        ["a", "a", "b", "b"])
    assert m["generate/avg_num_tokens"] == 5.0 and m["generate/min_num_tokens"] == 2.0
    assert m["generate/max_num_tokens"] == 8.0
    assert m["generate/std_num_tokens"] == pytest.approx(math.sqrt(5))
    # SkyRL's "non zero" is a positive reward (the -1.0 counts in neither mean)
    assert m["generate/avg_tokens_non_zero_rewards"] == 2.0
    assert m["generate/avg_tokens_zero_rewards"] == 6.0
    assert m["generate/truncated_frac"] == 0.25
    assert m["reward/accuracy"] == 0.25 and m["reward/solve_none_frac"] == 0.5
    none_positive = rollout_metrics([0.0], [[0, 0, 0]], ["stop"], ["a"])
    assert none_positive["generate/avg_tokens_non_zero_rewards"] == 0.0
    assert none_positive["generate/std_num_tokens"] == 0.0


def test_advantage_metrics_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    advantages = torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # returns 1.0 and 0.5; advantages on the 5 response tokens: 1 - 2 + 3 + 4 + 5 = 11, |.| 15
    assert advantage_metrics(rewards, advantages, mask) == {
        "loss/avg_final_rewards": pytest.approx(0.75), "loss/avg_raw_advantages": pytest.approx(11 / 5),
        "loss/avg_raw_advantages_abs": pytest.approx(15 / 5)}


def test_environment_metrics_by_hand():
    # one class: its aggregate under SkyRL's names only
    assert environment_metrics({"a": ClassMetrics({"x": 1.5}, {"x": 2})}) == {"environment/x": 1.5}
    # two classes: a shared key weighted by the episodes that reported it ((2 * 2 + 5 * 1) / 3), and
    # per class; a key of one class once
    got = environment_metrics({"a": ClassMetrics({"x": 2.0, "y": 2.0}, {"x": 2, "y": 1}),
                               "b": ClassMetrics({"x": 5.0}, {"x": 1})})
    assert got == {"environment/x": 3.0, "environment/a/x": 2.0, "environment/b/x": 5.0, "environment/y": 2.0}


def test_the_default_aggregation_is_skyrl_gyms_mean_of_numbers():
    from ridgeline.envs.base import mean_of_numbers

    episodes = [{"x": 1, "ok": True, "name": "a"}, {"x": 3.0, "ok": False, "bad": float("nan")}, {}]
    assert mean_of_numbers(episodes) == {"x": 2.0, "ok": 0.5}


def test_rollout_train_prob_ratio_mean_and_std_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    rollout = trainer + torch.log(torch.tensor([[1.0, 2.0, 9.0], [0.5, 1.5, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # q = 1, 2, 0.5, 1.5 on the masked tokens (the 9 is not): mean 1.25, squared deviations
    # 0.0625 + 0.5625 + 0.5625 + 0.0625 = 1.25, unbiased std sqrt(1.25 / 3)
    first = prob_ratio_moments(trainer[:1], rollout[:1], mask[:1])
    second = prob_ratio_moments(trainer[1:], rollout[1:], mask[1:])
    summed = [a + b for a, b in zip(first, second)]   # micro-batches (and ranks) add up
    mean, std = ratio_mean_std(*summed)
    q = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)
    assert mean == pytest.approx(1.25) and std == pytest.approx(math.sqrt(1.25 / 3))
    assert std == pytest.approx(q.std().item())   # torch's default (n - 1), SkyRL's
    mean, std = ratio_mean_std(*prob_ratio_moments(trainer[:1], rollout[:1], torch.tensor([[0, 1, 0]])))
    assert mean == pytest.approx(2.0) and math.isnan(std)
    with pytest.raises(ValueError, match="no tokens"):
        ratio_mean_std(0.0, 0.0, 0.0)
