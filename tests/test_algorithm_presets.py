"""Every algorithm preset (`+experiment=NAME`) runs the real loop end to end: the preset's own
keys on the quickstart task, with the quickstart model swapped for the tiny random one."""

from __future__ import annotations

import math

import pytest
import torch

from ridgeline.config import load_config
from ridgeline.trainer.trainer import Trainer

PRESETS = ["grpo", "drgrpo", "rloo", "ppo", "reinforce_pp", "dapo", "gspo", "cispo"]

# The quickstart task shrunk to the tiny model: 2 steps of 8 prompts x 8 samples, 4 tokens each.
TINY_TASK = [
    "trainer.policy.model.path=tiny://llama",
    "trainer.policy.model.gguf_file=null",
    "trainer.mixed_precision=fp32",
    "generator.model_dtype=float32",
    "trainer.policy.optimizer_config.lr=1e-3",
    "data.prepare.num_train=16",
    "data.prepare.num_val=8",
    "data.prepare.min_operand=0",
    "data.prepare.max_operand=9",
    "generator.sampling_params.max_generate_length=4",
    "generator.sampling_params.temperature=1.0",
    "generator.eval_sampling_params.max_generate_length=4",
    "trainer.eval_before_train=false",
    "+environment.skyrl_gym.arithmetic.format_score=0.5",
]


def run_preset(name: str, out, *extra: str) -> tuple[Trainer, list[dict]]:
    cfg = load_config([f"+experiment={name}", *TINY_TASK, f"trainer.export_path={out}", *extra])
    trainer = Trainer.from_config(cfg)
    trainer.train()
    return trainer, [r for r in trainer.history if "policy/policy_loss" in r or "dynamic_sampling/skipped_steps" in r]


def finite(rows: list[dict], key: str) -> list[float]:
    values = [r[key] for r in rows if key in r]
    assert values and all(math.isfinite(v) for v in values), (key, values)
    return values


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.integration
def test_preset_runs_end_to_end(name: str, tmp_path) -> None:
    extra = ("trainer.algorithm.overlong_buffer_len=2",) if name == "dapo" else ()
    trainer, steps = run_preset(name, tmp_path, *extra)
    cfg, alg = trainer.cfg, trainer.cfg.trainer.algorithm
    assert trainer.run.global_step == 2 and len(steps) == 2
    assert cfg.trainer.run_name == name
    for key in ("reward/avg_raw_reward", "policy/policy_loss", "policy/raw_grad_norm", "policy/ppo_clip_ratio",
                "policy/ratio_mean", "policy/ratio_max", "policy/ppo_kl",
                "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max"):
        finite(steps, key)
    # the reference model exists exactly when a KL option needs it
    assert (trainer.workers.ref is not None) == bool(alg.use_kl_loss or alg.use_kl_in_reward)
    assert (trainer.workers.critic is not None) == (name == "ppo")
    mini_steps = cfg.trainer.train_batch_size // cfg.trainer.policy_mini_batch_size
    assert all(r["policy/policy_update_steps"] == mini_steps for r in steps)
    assert (trainer.run_dir / "final_model" / "config.json").exists()

    if alg.use_kl_loss:
        finite(steps, "policy/policy_kl")
    if name == "rloo":
        assert finite(steps, "loss/kl_loss_coef") == [pytest.approx(0.001)] * 2
        finite(steps, "loss/avg_kl")
    if name == "ppo":
        finite(steps, "critic/value_loss")
        # critic_mini_batch_size 4 of 8 prompts: two critic steps, taken before the policy's
        assert all(r["critic/critic_update_steps"] == 2 and "timing/critic_train" in r for r in steps)
        finite(steps, "reward/running_std")
        assert (trainer.run_dir / "final_critic").exists()
    if name == "dapo":
        assert all(r["dynamic_sampling/signal_groups"] >= 1 for r in steps)
        assert all(1 <= r["dynamic_sampling/sample_batches"] <= 4 for r in steps)
        finite(steps, "reward/overlong_penalty_mean")
    if name == "cispo":
        # CISPO clips the weight, never the token's gradient
        assert all(r["policy/ppo_clip_ratio"] <= 1.0 for r in steps)


def test_adaptive_kl_in_reward_moves_the_coefficient(tmp_path) -> None:
    _, steps = run_preset("rloo", tmp_path, "trainer.algorithm.kl_ctrl.type=adaptive",
                          "trainer.algorithm.kl_ctrl.kl_target=1e-6", "trainer.algorithm.kl_ctrl.horizon=64",
                          "trainer.algorithm.kl_estimator_type=k3", "trainer.algorithm.kl_loss_coef=0.01",
                          "data.prepare.num_train=24")
    kls = [r["loss/avg_kl"] for r in steps]
    coefs = [r["loss/kl_loss_coef"] for r in steps]
    # step 1: policy == reference, KL 0, far below the target: e = -1 -> -0.2, and 64 samples over a
    # horizon of 64 give beta *= 1 - 0.2 = 0.8. Step 2: the policy has moved, KL > 1e-6: e = +0.2,
    # beta *= 1.2.
    assert kls[0] == pytest.approx(0.0, abs=1e-7) and kls[1] > 1e-6
    assert coefs == [pytest.approx(0.01), pytest.approx(0.008), pytest.approx(0.0096)]


def test_update_ref_every_epoch_copies_the_policy(tmp_path) -> None:
    trainer, _ = run_preset("grpo", tmp_path, "trainer.epochs=2", "trainer.update_ref_every_epoch=true",
                            "data.prepare.num_train=8")
    policy = dict(trainer.workers.policy.model.named_parameters())
    # refreshed after epoch 1, then the policy trained one more step: close but not equal
    diffs = [float((p - policy[name]).detach().abs().max()) for name, p in trainer.workers.ref.model.named_parameters()]
    assert max(diffs) > 0.0 and max(diffs) < 0.1


def test_update_ref_every_epoch_sets_ref_to_policy(tmp_path) -> None:
    cfg = load_config(["+experiment=grpo", *TINY_TASK, f"trainer.export_path={tmp_path}",
                       "trainer.update_ref_every_epoch=true"])
    trainer = Trainer.from_config(cfg)
    with torch.no_grad():
        for p in trainer.workers.policy.model.parameters():
            p.add_(0.01)
    trainer.update_ref()
    for (name, ref), (_, pol) in zip(trainer.workers.ref.model.named_parameters(), trainer.workers.policy.model.named_parameters()):
        assert torch.equal(ref, pol), name


def test_dynamic_sampling_replace_keeps_the_batch_size(tmp_path) -> None:
    _, steps = run_preset("dapo", tmp_path, "trainer.algorithm.dynamic_sampling.type=replace",
                          "trainer.algorithm.dynamic_sampling.min_replace_ratio=0.0",
                          "trainer.algorithm.overlong_buffer_len=null")
    for r in steps:
        signal, replaced = r["dynamic_sampling/signal_groups"], r["dynamic_sampling/replaced_groups"]
        # every signal-less group is replaced (min_replace_ratio 0) unless none had signal
        assert signal + replaced == 8 or signal == 0


def test_dynamic_sampling_without_any_signal_skips_the_update(tmp_path) -> None:
    # format_score 1.0: every number scores 1.0, wrong or right, and the tiny model's answers that
    # are not numbers score 0 -- force no signal at all by making every sample score the same:
    # the arithmetic env with correct_score == format_score == 0 gives everything 0.
    _, steps = run_preset("dapo", tmp_path, "+environment.skyrl_gym.arithmetic.correct_score=0.0",
                          "environment.skyrl_gym.arithmetic.format_score=0.0",
                          "trainer.algorithm.overlong_buffer_len=null",
                          "trainer.algorithm.dynamic_sampling.max_sample_batches=2")
    assert [r.get("dynamic_sampling/skipped_steps") for r in steps] == [1.0, 1.0]
    assert all(r["dynamic_sampling/sample_batches"] == 2 for r in steps)
