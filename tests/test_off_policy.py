"""Off-policy correction in the loop: the rollout/trainer logprob mismatch, TIS and SkyRL 0.4's masks
(the functions by hand: tests/test_off_policy_correction.py)."""

import math

import pytest
import torch

from ridgeline.algorithms.off_policy import logprob_mismatch, rollout_kl_sum
from ridgeline.config import ConfigError, load_config


def test_logprob_mismatch_sums_are_exact_over_the_mask():
    trainer = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -9.0]])
    rollout = torch.tensor([[-1.5, -2.0, 0.0], [-0.25, -1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    total, worst, count = logprob_mismatch(trainer, rollout, mask)
    # |0.5| + 0 + |-0.25| + |1.0| = 1.75 over 4 tokens; the masked -9 vs 0 does not count
    assert (total, worst, count) == (1.75, 1.0, 4.0)


def test_rollout_kl_is_k3_over_the_mask():
    trainer = torch.tensor([[-1.0, -2.0, 5.0]])
    rollout = torch.tensor([[-1.0, -1.0, 0.0]])
    # rho = [1, exp(-1)]: k3 = 0 + (exp(-1) - 1 + 1) = 0.3678794; the masked third token does not count
    assert rollout_kl_sum(trainer, rollout, torch.tensor([[1.0, 1.0, 0.0]])) == pytest.approx(math.exp(-1))


def test_use_tis_needs_a_positive_cap():
    base = ["+experiment=tiny", "trainer.algorithm.use_tis=true"]
    with pytest.raises(ConfigError, match="tis_imp_ratio_cap"):
        load_config(base)
    assert load_config(base + ["trainer.algorithm.tis_imp_ratio_cap=2.0"]).trainer.algorithm.use_tis is True


@pytest.mark.integration
def test_the_loop_reports_mismatch_and_applies_tis(tmp_path):
    from ridgeline.trainer.trainer import Trainer
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=16",
                       "trainer.eval_before_train=false", "trainer.algorithm.use_tis=true",
                       "trainer.algorithm.tis_imp_ratio_cap=2.0"])
    trainer = Trainer.from_config(cfg)
    rows = next(trainer.train_data.batches(cfg.trainer.train_batch_size, seed=0, epoch=0))
    trainer.run.global_step = 1
    metrics = trainer.train_step(rows)
    # the tiny preset runs engine and trainer in fp32: the same numbers, up to kernel rounding
    assert metrics["rollout/logprob_abs_diff_mean"] < 1e-4
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-4
    assert 0 <= metrics["rollout/kl_rollout_trainer"] < 1e-8
    # use_tis is SkyRL 0.4's token TIS: its metrics, under SkyRL 0.4's names
    assert metrics["policy/loss_metrics/is_ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["policy/loss_metrics/tis_token_clip_high_ratio"] == 0.0


def test_the_loop_applies_skyrl04_masks_with_prompt_mean(tmp_path):
    from ridgeline.trainer.trainer import Trainer
    opc = "trainer.algorithm.off_policy_correction"
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=16",
                       "trainer.eval_before_train=false", f"{opc}.sequence_mask_metric=geometric",
                       f"{opc}.token_mask_is_threshold_low=0.5", f"{opc}.token_mask_is_threshold_high=2.0",
                       f"{opc}.outlier_token_is_threshold_high=100", "trainer.algorithm.loss_reduction=prompt_mean",
                       "trainer.micro_train_batch_size_per_gpu=12"])
    trainer = Trainer.from_config(cfg)
    rows = next(trainer.train_data.batches(cfg.trainer.train_batch_size, seed=0, epoch=0))
    trainer.run.global_step = 1
    metrics = trainer.train_step(rows)
    # fp32 engine and trainer agree to < 1e-4, so nothing is masked and every ratio is 1
    assert metrics["policy/loss_metrics/geo_sequence_mask_masked_ratio"] == 0.0
    assert metrics["policy/loss_metrics/token_mask_ratio"] == 0.0
    assert metrics["policy/loss_metrics/outlier_seq_masked_ratio"] == 0.0
    assert metrics["policy/loss_metrics/is_ratio_min"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["policy/loss_metrics/is_ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert math.isfinite(metrics["policy/policy_loss"])
