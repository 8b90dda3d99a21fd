"""Off-policy correction: truncated importance weights and the rollout/trainer logprob mismatch."""

import math

import pytest
import torch

from ridgeline.algorithms.off_policy import logprob_mismatch, truncated_importance_weights
from ridgeline.config import ConfigError, load_config


def test_truncated_importance_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.0, -1.0, -2.5]])
    w = truncated_importance_weights(old, rollout, cap=2.0)
    # exp(0) = 1;  exp(-2 - -1) = exp(-1) = 0.36788;  exp(-0.5 - -2.5) = exp(2) = 7.389 -> capped at 2
    assert w[0].tolist() == pytest.approx([1.0, math.exp(-1.0), 2.0])
    with pytest.raises(ValueError, match="tis_imp_ratio_cap"):
        truncated_importance_weights(old, rollout, cap=-1.0)


def test_logprob_mismatch_sums_are_exact_over_the_mask():
    trainer = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -9.0]])
    rollout = torch.tensor([[-1.5, -2.0, 0.0], [-0.25, -1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    total, worst, count = logprob_mismatch(trainer, rollout, mask)
    # |0.5| + 0 + |-0.25| + |1.0| = 1.75 over 4 tokens; the masked -9 vs 0 does not count
    assert (total, worst, count) == (1.75, 1.0, 4.0)


def test_use_tis_needs_a_positive_cap():
    base = ["+experiment=tiny", "trainer.algorithm.use_tis=true"]
    with pytest.raises(ConfigError, match="tis_imp_ratio_cap"):
        load_config(base)
    assert load_config(base + ["trainer.algorithm.tis_imp_ratio_cap=2.0"]).trainer.algorithm.use_tis is True


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
    assert metrics["policy/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)
