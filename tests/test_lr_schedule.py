"""Learning-rate schedules (`optimizer_config.scheduler`): transformers' schedules step for step,
their length in optimizer steps, and a resumed run's learning rates."""

from __future__ import annotations

import pytest
import torch
from transformers import (get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup,
                          get_polynomial_decay_schedule_with_warmup)

from ridgeline.config import load_config
from ridgeline.trainer.trainer import Trainer
from ridgeline.training.build import lr_schedule
from ridgeline.training.optim import LRSchedule, build_scheduler


def _lrs(make, steps: int) -> list[float]:
    """The learning rate of each of `steps` optimizer steps, for a schedule `make(optimizer)`."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    scheduler = make(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("name, reference", [
    ("linear", lambda o: get_linear_schedule_with_warmup(o, 3, 10)),
    ("cosine", lambda o: get_cosine_schedule_with_warmup(o, 3, 10)),
    ("polynomial", lambda o: get_polynomial_decay_schedule_with_warmup(o, 3, 10)),
])
def test_a_schedule_is_transformers_own_step_for_step(name, reference):
    ours = _lrs(lambda o: build_scheduler(o, LRSchedule(name, num_warmup_steps=3, num_training_steps=10)), 12)
    assert ours == _lrs(reference, 12)


def test_linear_warms_up_from_0_as_skyrl_then_decays_to_0_at_the_last_step():
    lrs = _lrs(lambda o: build_scheduler(o, LRSchedule("linear", num_warmup_steps=2, num_training_steps=6)), 7)
    assert lrs == pytest.approx([0.0, 0.05, 0.1, 0.075, 0.05, 0.025, 0.0], abs=1e-12)


def test_the_schedule_runs_over_the_optimizer_steps_of_the_whole_run():
    cfg = load_config(["+experiment=tiny", "trainer.train_batch_size=16", "trainer.policy_mini_batch_size=4",
                       "trainer.update_epochs_per_batch=2", "trainer.critic.model.path=tiny://llama",
                       "trainer.critic_mini_batch_size=8", "trainer.micro_train_batch_size_per_gpu=8",
                       "trainer.algorithm.advantage_estimator=gae", "trainer.policy.optimizer_config.scheduler=cosine",
                       "trainer.policy.optimizer_config.num_warmup_steps=5"])
    # 7 batches x (2 passes x 16 / 4 mini-batches) for the policy, x (2 x 16 / 8) for the critic
    assert lr_schedule(cfg, "policy", training_batches=7) == LRSchedule("cosine", 5, 56)
    assert lr_schedule(cfg, "critic", training_batches=7) == LRSchedule("constant_with_warmup", 0, 28)


class StopAt(Trainer):
    """Stops (as a crash would) when step `at` begins."""
    at = 3

    def train_step(self, rows):
        if self.run.global_step == self.at:
            raise RuntimeError("crash")
        return super().train_step(rows)


@pytest.mark.integration
def test_a_resumed_run_has_the_learning_rates_of_an_uninterrupted_one(tmp_path):
    """4 steps x 2 optimizer steps: linear with 2 warmup steps over 8 optimizer steps, so the last
    step ends at lr 0; a run stopped after step 2's checkpoint and resumed logs the same rates."""
    def tiny(out, *extra):
        return load_config(["+experiment=tiny", f"trainer.export_path={out}", "data.prepare.num_train=32",
                            "trainer.eval_before_train=false", "data.prepare.num_val=4", "trainer.epochs=2",
                            "trainer.policy_mini_batch_size=8", "trainer.algorithm.use_kl_loss=false",
                            "trainer.policy.optimizer_config.scheduler=linear",
                            "trainer.policy.optimizer_config.num_warmup_steps=2", *extra])

    whole = Trainer.from_config(tiny(tmp_path / "whole"))
    whole.train()
    expected = [row["policy/policy_lr"] for row in whole.history if "policy/policy_lr" in row]
    # after optimizer steps 2, 4, 6, 8 of lambda(s) = (8 - s) / 6 past the warmup
    assert expected == pytest.approx([1e-2, 1e-2 * 4 / 6, 1e-2 * 2 / 6, 0.0], abs=1e-15)

    stopped = StopAt.from_config(tiny(tmp_path / "parts", "trainer.ckpt_interval=2"))
    with pytest.raises(RuntimeError, match="crash"):
        stopped.train()
    resumed = Trainer.from_config(tiny(tmp_path / "parts", "trainer.ckpt_interval=2", "trainer.resume_mode=latest"))
    assert resumed.run.global_step == 2
    resumed.train()
    parts = [row["policy/policy_lr"] for t in (stopped, resumed) for row in t.history if "policy/policy_lr" in row]
    assert parts == expected  # exactly
