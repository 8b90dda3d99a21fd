"""Critic worker for one process: values of a batch, and the critic's optimizer steps.

Same batch-size mapping as the policy worker: a mini-batch (`critic_mini_batch_size *
n_samples_per_prompt` samples, computed by the caller) is one optimizer step, split into
micro-batches of `micro_train_batch_size_per_gpu` for gradient accumulation, the whole batch
repeated `update_epochs_per_batch` times. Each optimizer step runs inside `loss_normalizers` with
the mini-batch's counts, so the accumulated micro-batch gradients equal the mini-batch gradient.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ridgeline.algorithms.reductions import loss_normalizers
from ridgeline.algorithms.value_loss import value_loss
from ridgeline.models.value_model import ValueModel
from ridgeline.tracking.progress import progress
from ridgeline.training.batch import TrainingBatch
from ridgeline.training.forward_path import PLAIN, ForwardOptions, micro_values
from ridgeline.training.worker import apply_gradients, autocast_context, check_loss

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CriticTrainConfig:
    mini_batch_size: int            # samples per optimizer step
    micro_batch_size: int           # samples per forward/backward
    micro_forward_batch_size: int   # samples per forward-only pass
    update_epochs: int = 1
    value_clip: float | None = 0.2  # <= 0 or None: unclipped value loss
    loss_reduction: str = "token_mean"
    max_grad_norm: float = 1.0
    autocast_dtype: torch.dtype | None = None
    nonfinite_loss: str = "skip"    # trainer.nonfinite_loss: skip | stop
    # trainer.use_sample_packing (and the pack cap): packed or padded critic forwards
    forward_options: ForwardOptions = PLAIN


@dataclass
class _StepSums:
    """Token-weighted sums over the micro-batches of an optimizer step, for the metrics."""
    loss: float = 0.0
    tokens: float = 0.0
    clip_tokens: float = 0.0
    values_tokens: float = 0.0
    returns_tokens: float = 0.0
    nonfinite: bool = False  # a micro-batch loss was NaN/inf: the step must be dropped


class CriticWorker:
    def __init__(self, model: ValueModel, config: CriticTrainConfig, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.model = model
        self.config = config
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.skipped_steps = 0

    @torch.no_grad()
    def compute_values(self, batch: TrainingBatch) -> torch.Tensor:
        """V(state before each response token), [B, R] float32, zero outside the response mask."""
        c = self.config
        was_training = self.model.training
        self.model.eval()
        parts = []
        for micro in batch.chunks(c.micro_forward_batch_size):
            with autocast_context(c.autocast_dtype):
                parts.append(micro_values(self.model, micro, c.forward_options).float())
        self.model.train(was_training)
        return torch.cat(parts) * batch.response_mask

    def train(self, batch: TrainingBatch) -> dict[str, float]:
        """Regress the values on `batch.returns`, clipped around `batch.values` (the critic before
        this step's updates)."""
        if batch.values is None or batch.returns is None:
            raise ValueError("CriticWorker.train needs batch.values (compute_values before any update) "
                             "and batch.returns (from the gae estimator)")
        c = self.config
        self.model.train()
        losses: list[float] = []
        grad_norms: list[float] = []
        total = _StepSums()
        with progress(c.update_epochs * math.ceil(batch.batch_size / c.mini_batch_size), "train critic") as bar:
            for _ in range(c.update_epochs):
                for mini in batch.chunks(c.mini_batch_size):
                    sums = self.accumulate_gradients(mini)
                    grad_norms.append(apply_gradients(self, "critic", c.max_grad_norm,
                                                      "non-finite value loss" if sums.nonfinite else None))
                    losses.append(sums.loss)
                    for name in ("tokens", "clip_tokens", "values_tokens", "returns_tokens"):
                        setattr(total, name, getattr(total, name) + getattr(sums, name))
                    bar.update()
        steps = max(1, len(grad_norms))
        tokens = max(1.0, total.tokens)
        return {
            "critic/value_loss": sum(losses) / steps,
            "critic/vf_clip_frac": total.clip_tokens / tokens,
            "critic/values_mean": total.values_tokens / tokens,
            "critic/returns_mean": total.returns_tokens / tokens,
            "critic/grad_norm": sum(grad_norms) / steps,
            "critic/lr": self.scheduler.get_last_lr()[0],
            "critic/optimizer_steps": float(len(grad_norms)),
            "critic/skipped_steps": float(self.skipped_steps),
        }

    def step_normalizers(self, mini: TrainingBatch) -> tuple[float, float]:
        """(tokens, sequences) the value loss of this optimizer step divides by: the mini-batch's.
        Data-parallel workers return the sums over all ranks."""
        return float(mini.loss_mask.sum()), float(mini.batch_size)

    def accumulate_gradients(self, mini: TrainingBatch) -> _StepSums:
        """Zero the gradients, then forward/backward every micro-batch of `mini`: afterwards `.grad`
        holds the gradient of the mini-batch loss, whatever the micro-batch size. A NaN/inf
        micro-batch loss stops the accumulation before its backward (`nonfinite` is set)."""
        c = self.config
        sums = _StepSums()
        self.optimizer.zero_grad(set_to_none=True)
        with loss_normalizers(*self.step_normalizers(mini)):
            for micro in mini.chunks(c.micro_batch_size):
                with autocast_context(c.autocast_dtype):
                    values = micro_values(self.model, micro, c.forward_options)
                loss, metrics = value_loss(values, micro.values, micro.returns, micro.loss_mask,
                                           c.value_clip, c.loss_reduction)
                loss_value = check_loss(loss, "critic value loss", c.nonfinite_loss)
                if loss_value is None:
                    sums.nonfinite = True
                    break
                loss.backward()
                tokens = float(micro.loss_mask.sum())
                sums.loss += loss_value  # the micro losses add up to the mini-batch loss
                sums.tokens += tokens
                sums.clip_tokens += metrics["vf_clip_frac"] * tokens
                sums.values_tokens += metrics["values_mean"] * tokens
                sums.returns_tokens += metrics["returns_mean"] * tokens
        return sums
