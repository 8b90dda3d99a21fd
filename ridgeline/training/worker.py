"""Policy and reference workers for one process (`trainer.strategy=single`).

A worker owns a model and answers two questions: "what are the logprobs of these responses?"
and (policy only) "take the optimizer steps for this batch". The batch-size keys map exactly:
a mini-batch (`policy_mini_batch_size * n_samples_per_prompt` samples) is one optimizer step,
split into micro-batches of `micro_train_batch_size_per_gpu` for gradient accumulation, the whole
batch repeated `update_epochs_per_batch` times. Each optimizer step runs inside
`loss_normalizers(mini-batch tokens, mini-batch sequences)`, so every `reduce_loss` call (the policy
loss's, a user loss's, the KL and entropy terms) divides by mini-batch counts and the accumulated
micro-batch gradients equal the full mini-batch gradient.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ridgeline.algorithms import POLICY_LOSSES, kl_penalty, loss_normalizers, masked_mean, reduce_loss
from ridgeline.algorithms.off_policy import logprob_mismatch
from ridgeline.models.lora import adapters_disabled, is_lora, merged_named_parameters
from ridgeline.tracking.progress import progress
from ridgeline.training.batch import TrainingBatch
from ridgeline.training.forward_path import PLAIN, ForwardOptions, micro_logprobs

log = logging.getLogger(__name__)


def autocast_context(dtype: torch.dtype | None, device_type: str = "cpu"):
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


@torch.no_grad()
def batch_logprobs(model: PreTrainedModel, batch: TrainingBatch, micro_batch_size: int,
                   temperature: float, autocast_dtype: torch.dtype | None,
                   forward_options: ForwardOptions = PLAIN) -> torch.Tensor:
    """Forward-only logprobs of a whole batch, `micro_batch_size` rows at a time, each micro-batch
    on the path `forward_options` picks (`ridgeline.training.forward_path`)."""
    was_training = model.training
    model.eval()
    parts = []
    for micro in batch.chunks(micro_batch_size):
        with autocast_context(autocast_dtype):
            lp, _ = micro_logprobs(model, micro, temperature, forward_options)
        parts.append(lp.float())
    model.train(was_training)
    return torch.cat(parts) * batch.response_mask


@dataclass(frozen=True)
class PolicyTrainConfig:
    mini_batch_size: int            # samples per optimizer step
    micro_batch_size: int           # samples per forward/backward
    micro_forward_batch_size: int   # samples per forward-only pass
    update_epochs: int = 1
    temperature: float = 1.0
    policy_loss: str = "regular"
    loss_reduction: str = "token_mean"
    # the `trainer.algorithm` section, handed to the policy loss as its `config`
    algorithm: Any = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    use_entropy_loss: bool = False
    entropy_loss_coef: float = 0.0
    max_grad_norm: float = 1.0
    autocast_dtype: torch.dtype | None = None
    nonfinite_loss: str = "skip"    # trainer.nonfinite_loss: skip | stop
    # trainer.use_sample_packing (and the pack cap): which forward each micro-batch takes
    forward_options: ForwardOptions = PLAIN


class NonFiniteLossError(FloatingPointError):
    """A micro-batch loss was NaN or inf and `trainer.nonfinite_loss=stop`."""


def check_loss(loss: torch.Tensor, what: str, mode: str) -> float | None:
    """The loss as a float when it is finite; None (the caller drops the optimizer step) when it
    is not and `mode` is skip; raise NonFiniteLossError when `mode` is stop. Runs before
    backward, so a NaN never reaches the gradients."""
    value = loss.item()
    if math.isfinite(value):
        return value
    if mode == "stop":
        raise NonFiniteLossError(f"{what} is {value} (trainer.nonfinite_loss=stop)")
    return None


def apply_gradients(worker: Any, role: str, max_grad_norm: float, skip_reason: str | None = None) -> float:
    """End an optimizer step of `worker` (policy or critic): clip the accumulated gradients to
    `max_grad_norm`, step the optimizer and the schedule, and return the grad norm. One bad batch
    must not poison the weights: with a `skip_reason` (a non-finite loss) or a non-finite norm the
    gradients are dropped, the step counted in `worker.skipped_steps` and 0.0 returned; the
    schedule still advances (the step happened, its update was dropped)."""
    grad_norm = None
    if skip_reason is None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(worker.model.parameters(), max_grad_norm))
        if math.isfinite(grad_norm):
            worker.optimizer.step()
            worker.scheduler.step()
            return grad_norm
        skip_reason = f"non-finite grad norm ({grad_norm})"
    worker.skipped_steps += 1
    log.warning("%s: %s; optimizer step skipped (%d so far)", role, skip_reason, worker.skipped_steps)
    worker.optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()" is intended here
        warnings.simplefilter("ignore", UserWarning)
        worker.scheduler.step()
    return 0.0


# SkyRL's metric names for the two classic PPO diagnostics
_LOSS_METRIC_NAMES = {"clip_frac": "ppo_clip_ratio", "ppo_kl": "policy_kl"}


class RefWorker:
    def __init__(self, model: PreTrainedModel, micro_forward_batch_size: int, temperature: float,
                 autocast_dtype: torch.dtype | None, forward_options: ForwardOptions = PLAIN):
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.micro = micro_forward_batch_size
        self.temperature = temperature
        self.autocast_dtype = autocast_dtype
        self.forward_options = forward_options

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        return batch_logprobs(self.model, batch, self.micro, self.temperature, self.autocast_dtype,
                              self.forward_options)

    def load_from(self, policy: "PolicyWorker") -> None:
        """`update_ref_every_epoch`: the policy's current weights (cast to the reference's dtype)."""
        self.model.load_state_dict(policy.model.state_dict())


class BaseModelRefWorker(RefWorker):
    """The reference of a LoRA policy: the policy's own model with its adapters switched off,
    which is the frozen base model it started from. No second copy of the weights exists, and the
    logprobs are those of the base model loaded alone (bit for bit in fp32: a disabled LoRA layer
    runs its base layer only)."""

    def __init__(self, policy_model: PreTrainedModel, micro_forward_batch_size: int, temperature: float,
                 autocast_dtype: torch.dtype | None, forward_options: ForwardOptions = PLAIN):
        # Not RefWorker.__init__: it would switch the shared model to eval mode and freeze the
        # policy's adapters. batch_logprobs sets (and restores) eval mode around each pass.
        self.model = policy_model
        self.micro, self.temperature = micro_forward_batch_size, temperature
        self.autocast_dtype, self.forward_options = autocast_dtype, forward_options

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        with adapters_disabled(self.model):
            return super().compute_logprobs(batch)

    def load_from(self, policy: "PolicyWorker") -> None:
        raise RuntimeError("a LoRA policy's reference is its frozen base model and cannot take the policy's weights "
                           "(trainer.update_ref_every_epoch=true is refused with trainer.policy.model.lora.rank > 0)")


class PolicyWorker:
    def __init__(self, model: PreTrainedModel, config: PolicyTrainConfig,
                 optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.model = model
        self.config = config
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.policy_loss_fn = POLICY_LOSSES.get(config.policy_loss)
        self.skipped_steps = 0

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        c = self.config
        return batch_logprobs(self.model, batch, c.micro_forward_batch_size, c.temperature, c.autocast_dtype,
                              c.forward_options)

    def named_weights(self):
        """What the engine needs after an update: every parameter, by name. With LoRA the merged
        weights W + scaling * B @ A under the base model's names, computed one tensor at a time
        without touching the training weights (ridgeline.models.lora)."""
        if is_lora(self.model):
            return merged_named_parameters(self.model)
        return self.model.named_parameters()

    def train(self, batch: TrainingBatch) -> dict[str, float]:
        c = self.config
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        loss_sums: dict[str, float] = {}
        grad_norms: list[float] = []
        steps = c.update_epochs * math.ceil(batch.batch_size / c.mini_batch_size)
        with progress(steps, "train policy") as bar:
            for epoch in range(c.update_epochs):
                for mini in batch.chunks(c.mini_batch_size):
                    grad_norms.append(self._optimizer_step(mini, sums, loss_sums, first_epoch=epoch == 0))
                    bar.update()
        total_tokens = max(1.0, float(batch.loss_mask.sum()) * c.update_epochs)
        steps = max(1, len(grad_norms))
        metrics = {
            "policy/policy_loss": sums["policy_loss"] / steps,
            "policy/final_loss": sums["final_loss"] / steps,
            "policy/policy_entropy": sums["entropy_tokens"] / total_tokens,
            "policy/grad_norm": sum(grad_norms) / steps,
            "policy/policy_lr": self.scheduler.get_last_lr()[0],
            "policy/optimizer_steps": float(len(grad_norms)),
            "policy/skipped_steps": float(self.skipped_steps),
        }
        # The loss's own metrics: token-weighted means across micro-batches, `*_max` as maxima.
        for key, value in loss_sums.items():
            name = f"policy/{_LOSS_METRIC_NAMES.get(key, key)}"
            metrics[name] = value if key.endswith("_max") else value / total_tokens
        if c.use_kl_loss:
            metrics["policy/kl_loss"] = sums["kl_loss"] / steps
        if sums["mismatch_tokens"]:
            metrics["rollout/logprob_abs_diff_mean"] = sums["mismatch_sum"] / sums["mismatch_tokens"]
            metrics["rollout/logprob_abs_diff_max"] = sums["mismatch_max"]
        return metrics

    def step_normalizers(self, mini: TrainingBatch) -> tuple[float, float]:
        """(tokens, sequences) the losses of this optimizer step divide by: the mini-batch's.
        Data-parallel workers return the sums over all ranks."""
        return float(mini.loss_mask.sum()), float(mini.batch_size)

    def _optimizer_step(self, mini: TrainingBatch, sums: dict[str, float], loss_sums: dict[str, float],
                        first_epoch: bool) -> float:
        c = self.config
        self.optimizer.zero_grad(set_to_none=True)
        finite = True
        with loss_normalizers(*self.step_normalizers(mini)):
            for micro in mini.chunks(c.micro_batch_size):
                if not self._micro_step(micro, sums, loss_sums, first_epoch):
                    finite = False
                    break
        return apply_gradients(self, "policy", c.max_grad_norm, None if finite else "non-finite loss")

    def _micro_step(self, micro: TrainingBatch, sums: dict[str, float], loss_sums: dict[str, float],
                    first_epoch: bool) -> bool:
        """Forward and backward of one micro-batch; the gradient accumulates on the parameters.
        False (nothing accumulated) when the loss is not finite and nonfinite_loss is skip."""
        c = self.config
        with autocast_context(c.autocast_dtype):
            logprobs, entropy = micro_logprobs(self.model, micro, c.temperature, c.forward_options,
                                               with_entropy=True)
        mask = micro.loss_mask
        # No separate old-policy pass when the batch takes a single optimizer step (the trainer
        # decides): then pi_old == pi_theta at this point and its logprobs are our own, detached.
        old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
        if micro.rollout_logprobs is not None and first_epoch:
            # how far the engine's numbers are from the trainer's pi_old, on the tokens it sampled
            # (observation tokens of multi-turn rollouts carry no engine logprob)
            sampled = micro.sampled_mask if micro.sampled_mask is not None else micro.loss_mask
            total, worst, count = logprob_mismatch(old, micro.rollout_logprobs, sampled)
            sums["mismatch_sum"] += total
            sums["mismatch_tokens"] += count
            sums["mismatch_max"] = max(sums["mismatch_max"], worst)
        pg_loss, pg_metrics = self.policy_loss_fn(logprobs, old, micro.advantages, mask, c.algorithm,
                                                  rollout_log_probs=micro.rollout_logprobs)
        loss = pg_loss
        if c.use_kl_loss:
            kl_loss = reduce_loss(kl_penalty(logprobs, micro.ref_logprobs, c.kl_estimator), mask, c.loss_reduction)
            loss = loss + c.kl_loss_coef * kl_loss
            sums["kl_loss"] += kl_loss.item()
        if c.use_entropy_loss:
            loss = loss - c.entropy_loss_coef * reduce_loss(entropy, mask, c.loss_reduction)
        loss_value = check_loss(loss, "policy loss", c.nonfinite_loss)
        if loss_value is None:
            return False
        loss.backward()
        tokens = float(mask.sum())
        sums["policy_loss"] += pg_loss.item()
        sums["final_loss"] += loss_value
        sums["entropy_tokens"] += float(masked_mean(entropy.detach(), mask)) * tokens
        for key, value in pg_metrics.items():
            if key.endswith("_max"):
                loss_sums[key] = max(loss_sums.get(key, float("-inf")), float(value))
            else:
                loss_sums[key] = loss_sums.get(key, 0.0) + float(value) * tokens
        return True
