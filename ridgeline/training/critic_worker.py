"""Critic worker, one class for one process and every FSDP2 rank: values of a batch, and the
critic's optimizer steps.

Same batch-size mapping as the policy worker: a mini-batch (the samples of
`critic_mini_batch_size * n_samples_per_prompt` trajectories) is one optimizer step, split into
micro-batches of `micro_train_batch_size_per_gpu` samples for gradient accumulation, the whole
batch repeated `update_epochs_per_batch` times. Each optimizer step runs inside `loss_normalizers` with
the mini-batch's counts (summed over the ranks), so the accumulated micro-batch gradients equal the
mini-batch gradient. Batches come and values go back on the host, as for the policy worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR

from ridgeline.algorithms.reductions import loss_normalizers
from ridgeline.algorithms.value_loss import value_loss
from ridgeline.models.device import autocast
from ridgeline.models.loading import read_safetensors
from ridgeline.models.value_model import VALUE_HEAD_FILE, ValueModel, save_value_head
from ridgeline.tracking.progress import progress
from ridgeline.training.batch import TrainingBatch, required
from ridgeline.training.forward_path import PLAIN, ForwardOptions, micro_values
from ridgeline.training.parallel import DataParallel, SingleProcess, check_uniform_forwards, reduce_rank_metrics
from ridgeline.training.worker import TrainedWorker, state_from_folder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CriticTrainConfig:
    mini_batch_trajectories: int    # trajectories per optimizer step, all ranks together
    micro_batch_size: int           # samples per forward/backward
    micro_forward_batch_size: int   # samples per forward-only pass
    update_epochs: int = 1
    value_clip: float | None = 0.2  # <= 0 or None: unclipped value loss
    loss_reduction: str = "token_mean"
    max_seq_len: int | None = None  # seq_mean_token_sum_norm's constant (None: the padded width)
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
    micro_batches: int = 0
    nonfinite: bool = False  # a micro-batch loss was NaN/inf: the step must be dropped


_SUMMED = {"critic/value_loss", "critic/critic_loss"}
_SHARED = {"critic/raw_grad_norm", "critic/critic_lr", "critic/critic_update_steps", "critic/skipped_steps"}


class CriticWorker(TrainedWorker[ValueModel]):
    lora_key = "trainer.critic.model.lora"

    def __init__(self, model: ValueModel, config: CriticTrainConfig, optimizer: torch.optim.Optimizer,
                 scheduler: LambdaLR, parallel: DataParallel | None = None):
        super().__init__(model, optimizer, scheduler, parallel or SingleProcess())
        self.config = config

    @torch.no_grad()
    def compute_values(self, batch: TrainingBatch) -> torch.Tensor:  # collective
        """V(state before each response token), [B, R] float32 on the host, zero outside the
        response mask."""
        c = self.config
        micros = list(batch.chunks(c.micro_forward_batch_size))
        check_uniform_forwards(self.parallel, [1] * len(micros))
        was_training = self.model.training
        self.model.eval()
        parts = []
        for micro in micros:
            with autocast(self.parallel.device, c.autocast_dtype):
                parts.append(micro_values(self.model, micro, c.forward_options, self.parallel.device).float())
        self.model.train(was_training)
        return torch.cat(parts).cpu() * batch.response_mask  # one copy to the host

    def _read_full(self, folder: Path) -> dict[str, torch.Tensor]:
        """The backbone's Hugging Face files and the value head's, under the value model's names."""
        return state_from_folder(folder, prefix="backbone.", keep_prefixed=(VALUE_HEAD_FILE,))

    # a LoRA critic trains its backbone's adapters and its whole value head: both go in checkpoints
    def _write_trained(self, folder: Path, state: dict[str, torch.Tensor]) -> None:
        super()._write_trained(folder, state)
        prefix = f"{self.model.value_head_prefix}."
        save_value_head(folder, {k: v for k, v in state.items() if k.startswith(prefix)})

    def _read_trained(self, folder: Path) -> dict[str, torch.Tensor]:
        return {**super()._read_trained(folder), **read_safetensors([Path(folder) / VALUE_HEAD_FILE])}

    def train(self, batch: TrainingBatch) -> dict[str, float]:  # collective
        """Regress the values on `batch.returns`, clipped around `batch.values` (the critic before
        this step's updates). Metrics (docs/logging.md), SkyRL's: critic_loss (mean over
        micro-batches of the loss each back-propagated: about value_loss / micro-batches per
        mini-batch, as SkyRL logs it), values_mean, values_clipfrac, raw_grad_norm, critic_lr,
        critic_update_steps; Ridgeline's: value_loss (the mini-batch loss, mean over optimizer
        steps), returns_mean, skipped_steps."""
        if batch.values is None or batch.returns is None:
            raise ValueError("CriticWorker.train needs batch.values (compute_values before any update) "
                             "and batch.returns (from the gae estimator)")
        c = self.config
        self.model.train()
        losses: list[float] = []
        grad_norms: list[float] = []
        total = _StepSums()
        minis = batch.mini_batches(c.mini_batch_trajectories)
        with progress(c.update_epochs * len(minis), "train critic") as bar, self.optimizer_on_device():
            for _ in range(c.update_epochs):
                for mini in minis:
                    sums = self.accumulate_gradients(mini)
                    grad_norms.append(self.apply_gradients("critic", c.max_grad_norm,
                                                           "non-finite value loss" if sums.nonfinite else None))
                    losses.append(sums.loss)
                    for name in ("tokens", "clip_tokens", "values_tokens", "returns_tokens", "micro_batches"):
                        setattr(total, name, getattr(total, name) + getattr(sums, name))
                    bar.update()
        steps = max(1, len(grad_norms))
        tokens = max(1.0, total.tokens)
        metrics = {
            "critic/value_loss": sum(losses) / steps,
            "critic/critic_loss": sum(losses) / max(1, total.micro_batches),
            "critic/values_clipfrac": total.clip_tokens / tokens,
            "critic/values_mean": total.values_tokens / tokens,
            "critic/returns_mean": total.returns_tokens / tokens,
            "critic/raw_grad_norm": sum(grad_norms) / steps,
            "critic/critic_lr": float(self.scheduler.get_last_lr()[0]),
            "critic/critic_update_steps": float(len(grad_norms)),
            "critic/skipped_steps": float(self.skipped_steps),
        }
        return reduce_rank_metrics(self.parallel, metrics, float(batch.loss_mask.sum()) * c.update_epochs,
                                   prefix="critic/", summed=_SUMMED, shared=_SHARED)

    def accumulate_gradients(self, mini: TrainingBatch) -> _StepSums:  # collective
        """Zero the gradients, then forward/backward every micro-batch of `mini`: afterwards `.grad`
        holds the gradient of the mini-batch loss, whatever the micro-batch size. A NaN/inf
        micro-batch loss (on any rank) stops the accumulation before its backward (`nonfinite`)."""
        c = self.config
        device = self.parallel.device
        micros = list(mini.chunks(c.micro_batch_size))
        check_uniform_forwards(self.parallel, [1] * len(micros))
        sums = _StepSums()
        self.optimizer.zero_grad(set_to_none=True)
        tokens, sequences, micro_batches = self.step_normalizers(mini, len(micros))
        # the policy's loss_reduction: token_mean_legacy reads the micro-batches, prompt_mean the prompt groups
        divisors = self.prompt_divisors(mini, micros) if c.loss_reduction == "prompt_mean" else None
        with loss_normalizers(tokens, sequences, max_seq_len=c.max_seq_len, micro_batches=micro_batches) as norms:
            for index, micro in enumerate(micros):
                norms.prompt_divisors = divisors[index] if divisors is not None else None
                with autocast(device, c.autocast_dtype):
                    values = micro_values(self.model, micro, c.forward_options, device)
                micro = micro.to(device)
                loss, metrics = value_loss(values, required(micro.values, "critic values"),
                                           required(micro.returns, "returns"), micro.loss_mask,
                                           c.value_clip, c.loss_reduction)
                loss_value, tokens = torch.stack([loss.detach().float(), micro.loss_mask.sum().float()]).tolist()
                if not self.check_loss(loss_value, "critic value loss", c.nonfinite_loss):
                    sums.nonfinite = True
                    break
                loss.backward()
                sums.loss += loss_value  # the micro losses add up to the mini-batch loss
                sums.micro_batches += 1
                sums.tokens += tokens
                sums.clip_tokens += metrics["vf_clip_frac"] * tokens
                sums.values_tokens += metrics["values_mean"] * tokens
                sums.returns_tokens += metrics["returns_mean"] * tokens
        return sums
