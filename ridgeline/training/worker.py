"""Policy and reference workers for one process (`trainer.strategy=single`).

A worker owns a model and answers two questions: "what are the logprobs of these responses?"
and (policy only) "take the optimizer steps for this batch". The batch-size keys map exactly:
a mini-batch (`policy_mini_batch_size * n_samples_per_prompt` samples) is one optimizer step,
split into micro-batches of `micro_train_batch_size_per_gpu` for gradient accumulation, the whole
batch repeated `update_epochs_per_batch` times. Loss reductions receive the mini-batch's token
and sequence counts, so accumulated micro-batch gradients equal the full mini-batch gradient.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PreTrainedModel

from ridgeline.algorithms import (LOSS_REDUCTIONS, POLICY_LOSSES, PolicyLossConfig, kl_penalty,
                                  masked_mean)
from ridgeline.algorithms.off_policy import logprob_mismatch, truncated_importance_weights
from ridgeline.training.batch import TrainingBatch
from ridgeline.training.logprobs import response_logprobs

log = logging.getLogger(__name__)


def autocast_context(dtype: torch.dtype | None, device_type: str = "cpu"):
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


@torch.no_grad()
def batch_logprobs(model: PreTrainedModel, batch: TrainingBatch, micro_batch_size: int,
                   temperature: float, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Forward-only logprobs of a whole batch, `micro_batch_size` rows at a time."""
    was_training = model.training
    model.eval()
    parts = []
    for micro in batch.chunks(micro_batch_size):
        with autocast_context(autocast_dtype):
            lp, _ = response_logprobs(model, micro.sequences, micro.attention_mask,
                                      micro.response_width, temperature)
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
    loss_config: PolicyLossConfig = PolicyLossConfig()
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    use_entropy_loss: bool = False
    entropy_loss_coef: float = 0.0
    max_grad_norm: float = 1.0
    autocast_dtype: torch.dtype | None = None
    tis_cap: float | None = None    # use_tis: truncated importance weights against rollout logprobs


class RefWorker:
    def __init__(self, model: PreTrainedModel, micro_forward_batch_size: int, temperature: float,
                 autocast_dtype: torch.dtype | None):
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.micro = micro_forward_batch_size
        self.temperature = temperature
        self.autocast_dtype = autocast_dtype

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        return batch_logprobs(self.model, batch, self.micro, self.temperature, self.autocast_dtype)


class PolicyWorker:
    def __init__(self, model: PreTrainedModel, config: PolicyTrainConfig,
                 optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.model = model
        self.config = config
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.policy_loss_fn = POLICY_LOSSES.get(config.policy_loss)
        self.reduce = LOSS_REDUCTIONS.get(config.loss_reduction)
        self.skipped_steps = 0

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        c = self.config
        return batch_logprobs(self.model, batch, c.micro_forward_batch_size, c.temperature, c.autocast_dtype)

    def named_weights(self):
        """What the engine needs after an update: every parameter, by name."""
        return self.model.named_parameters()

    def train(self, batch: TrainingBatch) -> dict[str, float]:
        c = self.config
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        grad_norms: list[float] = []
        for epoch in range(c.update_epochs):
            for mini in batch.chunks(c.mini_batch_size):
                grad_norms.append(self._optimizer_step(mini, sums, first_epoch=epoch == 0))
        total_tokens = max(1.0, float(batch.loss_mask.sum()) * c.update_epochs)
        steps = max(1, len(grad_norms))
        metrics = {
            "policy/policy_loss": sums["policy_loss"] / steps,
            "policy/final_loss": sums["final_loss"] / steps,
            "policy/ppo_clip_ratio": sums["clip_frac_tokens"] / total_tokens,
            "policy/policy_kl": sums["ppo_kl_tokens"] / total_tokens,
            "policy/policy_entropy": sums["entropy_tokens"] / total_tokens,
            "policy/grad_norm": sum(grad_norms) / steps,
            "policy/policy_lr": self.scheduler.get_last_lr()[0],
            "policy/optimizer_steps": float(len(grad_norms)),
            "policy/skipped_steps": float(self.skipped_steps),
        }
        if c.use_kl_loss:
            metrics["policy/kl_loss"] = sums["kl_loss"] / steps
        if sums["mismatch_tokens"]:
            metrics["rollout/logprob_abs_diff_mean"] = sums["mismatch_sum"] / sums["mismatch_tokens"]
            metrics["rollout/logprob_abs_diff_max"] = sums["mismatch_max"]
        if c.tis_cap is not None:
            metrics["policy/tis_weight_mean"] = sums["tis_weight_tokens"] / total_tokens
        return metrics

    def _optimizer_step(self, mini: TrainingBatch, sums: dict[str, float], first_epoch: bool) -> float:
        c = self.config
        reduce = partial(self.reduce, num_tokens=float(mini.loss_mask.sum().clamp(min=1)),
                         num_sequences=float(mini.batch_size))
        self.optimizer.zero_grad(set_to_none=True)
        for micro in mini.chunks(c.micro_batch_size):
            with autocast_context(c.autocast_dtype):
                logprobs, entropy = response_logprobs(self.model, micro.sequences, micro.attention_mask,
                                                      micro.response_width, c.temperature, with_entropy=True)
            mask = micro.loss_mask
            # No separate old-policy pass when the batch takes a single optimizer step (the trainer
            # decides): then pi_old == pi_theta at this point and its logprobs are our own, detached.
            old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
            advantages = micro.advantages
            if micro.rollout_logprobs is not None:
                if first_epoch:  # how far the engine's numbers are from the trainer's pi_old
                    total, worst, count = logprob_mismatch(old, micro.rollout_logprobs, micro.response_mask)
                    sums["mismatch_sum"] += total
                    sums["mismatch_tokens"] += count
                    sums["mismatch_max"] = max(sums["mismatch_max"], worst)
                if c.tis_cap is not None:
                    # Scaling A_t by w_t > 0 scales the token's clipped PPO term by w_t (the
                    # surrogate is positively homogeneous in A), i.e. it weights the token's loss.
                    weights = truncated_importance_weights(old, micro.rollout_logprobs, c.tis_cap)
                    advantages = advantages * weights
                    sums["tis_weight_tokens"] += float((weights * mask).sum())
            pg_loss, pg_metrics = self.policy_loss_fn(logprobs, old, advantages, mask,
                                                      config=c.loss_config, reduction=reduce)
            loss = pg_loss
            if c.use_kl_loss:
                kl_loss = reduce(kl_penalty(logprobs, micro.ref_logprobs, c.kl_estimator), mask)
                loss = loss + c.kl_loss_coef * kl_loss
                sums["kl_loss"] += kl_loss.item()
            if c.use_entropy_loss:
                loss = loss - c.entropy_loss_coef * reduce(entropy, mask)
            loss.backward()
            tokens = float(mask.sum())
            sums["policy_loss"] += pg_loss.item()
            sums["final_loss"] += loss.item()
            sums["clip_frac_tokens"] += pg_metrics.get("clip_frac", 0.0) * tokens
            sums["ppo_kl_tokens"] += pg_metrics.get("ppo_kl", 0.0) * tokens
            sums["entropy_tokens"] += float(masked_mean(entropy.detach(), mask)) * tokens
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm))
        if not math.isfinite(grad_norm):
            # One bad batch must not poison the weights: drop its gradients, count it, go on.
            self.skipped_steps += 1
            log.warning("non-finite grad norm (%s); optimizer step skipped (%d so far)", grad_norm,
                        self.skipped_steps)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        self.scheduler.step()
        return grad_norm if math.isfinite(grad_norm) else 0.0
