"""A quickstart-shaped GRPO run on CUDA through the real trainer.

The quickstart preset (8 prompts x 8 samples, 16 generated tokens, bf16 engine, autocast bf16
training, no reference model) with SmolLM2-135M's architecture and random weights
(`random://smollm2-135m`, no hub), `trainer.device=cuda`, for STEPS steps over generated sums
written under tmp_path. Checks where the policy, the engine and the batches were, that the losses
are finite and that peak GPU memory is logged; prints rollout tokens/s, training tokens/s and MFU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from .gpu_figures import bf16_peak, mfu

from ridgeline.config import load_config
from ridgeline.trainer.trainer import Trainer

pytestmark = pytest.mark.gpu

STEPS = 4
PROMPTS_PER_STEP = 8  # the quickstart's train_batch_size


@dataclass
class Seen:
    """Device types met during the run (a CPU tensor among them fails the test)."""
    batch: set[str] = field(default_factory=set)    # micro-batch tensors the policy loss receives
    policy: set[str] = field(default_factory=set)   # policy parameters at the update
    engine: set[str] = field(default_factory=set)   # engine parameters while it generates


def watch_devices(trainer: Trainer) -> Seen:
    """Wrap the policy loss and the engine's generate to note where their tensors are. The trainer
    keeps its batches on the host; the worker moves each micro-batch to the GPU, so the loss sees
    the micro-batch's tensors there."""
    seen = Seen()
    policy = trainer.workers.policy
    loss_fn, generate = policy.policy_loss_fn, trainer.engine.generate

    def loss_and_look(log_probs, old_log_probs, advantages, loss_mask, config, rollout_log_probs=None):
        seen.batch |= {t.device.type for t in (log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs)
                       if t is not None}
        seen.policy |= {p.device.type for p in policy.model.parameters()}
        return loss_fn(log_probs, old_log_probs, advantages, loss_mask, config, rollout_log_probs=rollout_log_probs)

    def generate_and_look(*args, **kwargs):
        seen.engine |= {p.device.type for p in trainer.engine.model.parameters()}
        return generate(*args, **kwargs)

    policy.policy_loss_fn = loss_and_look
    trainer.engine.generate = generate_and_look
    return seen


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_cuda")
    cfg = load_config([
        "+experiment=quickstart", f"trainer.export_path={out}",
        "trainer.strategy=single", "trainer.device=cuda",
        "trainer.policy.model.path=random://smollm2-135m", "trainer.policy.model.gguf_file=null",
        f"data.prepare.num_train={PROMPTS_PER_STEP * STEPS}", "data.prepare.num_val=16",
        "trainer.eval_before_train=false",
        # the optimizer state stays where the update left it, so the test can look at it afterwards
        "trainer.policy.optimizer_config.offload_after_step=false",
    ])
    trainer = Trainer.from_config(cfg)
    seen = watch_devices(trainer)
    summary = trainer.train()
    steps = [row for row in trainer.history if "timing/policy_train" in row]
    return trainer, summary, steps, seen


def test_policy_engine_and_batches_live_on_cuda(run):
    trainer, summary, steps, seen = run
    assert summary["steps"] == len(steps) == STEPS
    assert seen.batch == {"cuda"}, seen.batch
    assert seen.policy == {"cuda"}, seen.policy
    assert seen.engine == {"cuda"}, seen.engine
    assert {p.device.type for p in trainer.workers.policy.model.parameters()} == {"cuda"}
    moments = [t for state in trainer.workers.policy.optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0]  # exp_avg, exp_avg_sq (not the step count)
    assert moments and {t.device.type for t in moments} == {"cuda"}


def test_losses_are_finite_and_peak_gpu_memory_is_logged(run):
    _, _, steps, _ = run
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    for row in steps:
        for key in ("policy/policy_loss", "policy/final_loss", "policy/raw_grad_norm"):
            assert math.isfinite(row[key]), (row["step"], key, row[key])
        assert 0 < row["memory/peak_gpu_gib"] <= total_gib, row["memory/peak_gpu_gib"]
        assert row["throughput/generate_tokens_per_second"] > 0


def test_throughput_and_mfu(run, figures):
    """Figures of the warm steps (the first one loads CUDA kernels and autotunes)."""
    trainer, _, steps, _ = run
    warm = steps[1:]
    parameters = sum(p.numel() for p in trainer.workers.policy.model.parameters())
    # throughput/tokens_per_second is the step's trained tokens (attention mask) over the step's seconds
    trained = [row["throughput/tokens_per_second"] * row["timing/step"] for row in warm]
    train_seconds = [row["timing/policy_train"] for row in warm]
    device = torch.cuda.get_device_name()
    peak = bf16_peak(device)
    values: dict[str, float | str] = {
        "model": "random://smollm2-135m (quickstart shape)",
        "parameters": float(parameters),
        "steps_measured": float(len(warm)),
        "step_seconds": sum(row["timing/step"] for row in warm) / len(warm),
        "rollout_tokens_per_second": sum(row["throughput/generate_tokens_per_second"] for row in warm) / len(warm),
        "trained_tokens_per_step": sum(trained) / len(warm),
        "training_tokens_per_second": sum(trained) / sum(train_seconds),
        "peak_gpu_gib": max(row["memory/peak_gpu_gib"] for row in steps),
        "bf16_peak": f"{peak.label}: {peak.tflops:.0f} TFLOP/s dense" if peak else f"not in the table: {device}",
    }
    if peak is not None:
        values["mfu"] = mfu(parameters, sum(trained), sum(train_seconds), peak)
    figures.record("grpo_step_cuda", **values)
    assert values["training_tokens_per_second"] > 0 and values["rollout_tokens_per_second"] > 0
    assert peak is None or 0 < values["mfu"] < 1
