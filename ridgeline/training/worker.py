"""Policy and reference workers: one class each for one process and for every FSDP2 rank.

A worker owns a model and answers two questions: "what are the logprobs of these responses?"
and (policy only) "take the optimizer steps for this batch". The batch-size keys map exactly:
a mini-batch (the samples of `policy_mini_batch_size * n_samples_per_prompt` trajectories: one
each, or one per turn with step-wise training; each rank holds its share) is one optimizer step,
split into micro-batches of `micro_train_batch_size_per_gpu` samples for gradient accumulation,
the whole batch repeated `update_epochs_per_batch` times. Each optimizer step runs inside
`loss_normalizers(mini-batch tokens, mini-batch samples)` summed over the ranks (a rank's padding
rows count in neither), so every `reduce_loss` call (the policy loss's, a user loss's, the KL and
entropy terms) divides by the global mini-batch counts and the accumulated (and, on FSDP2,
summed) micro-batch gradients equal the full mini-batch gradient.

Where things live: batches come and results go back on the host; each micro-batch is moved to
the worker's device (`parallel.device`) just before its forward. The worker's group
(`ridgeline.training.parallel`) is a world of one in one process; on FSDP2 ranks the same code's
all-reduces make the ranks agree (see `ridgeline.distributed.fsdp` for why the sums are exact).
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Iterator, Mapping, Protocol, TYPE_CHECKING

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:  # a policy loss's `config` (ridgeline.config sits above this layer)
    from ridgeline.config.loss_view import LossConfig
    from ridgeline.models.lora import MaybeAdapted
from ridgeline.algorithms import PolicyLoss, kl_penalty, loss_normalizers, masked_mean, reduce_loss
from ridgeline.algorithms.off_policy import logprob_mismatch, prob_ratio_moments, ratio_mean_std, rollout_kl_sum
from ridgeline.errors import UserError
from ridgeline.models.device import autocast
from ridgeline.models.loading import read_safetensors, save_hf_weights
from ridgeline.models.lora import AdapterLayout, adapter_layout, adapters_disabled, is_adapter_folder, plain
from ridgeline.tracking.progress import progress
from ridgeline.training.batch import TrainingBatch, required
from ridgeline.training.forward_path import PLAIN, ForwardOptions, agreed_forward_options, micro_logprobs
from ridgeline.training.optim import restore_optimizer
from ridgeline.training.parallel import M, DataParallel, SingleProcess, reduce_rank_metrics
from ridgeline.training.profiler import StepProfiler

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """A micro-batch loss was NaN or inf and `trainer.nonfinite_loss=stop`."""


class WeightsMismatchError(ValueError):
    """Saved weights do not fit the worker's model (another model, LoRA settings, ...)."""


@torch.no_grad()
def batch_logprobs(model: MaybeAdapted, batch: TrainingBatch, micro_batch_size: int, temperature: float,
                   autocast_dtype: torch.dtype | None, parallel: DataParallel,
                   forward_options: ForwardOptions = PLAIN) -> torch.Tensor:
    """Forward-only logprobs `[B, R]` of a host batch, on the host: `micro_batch_size` rows at a
    time on `parallel.device`, each micro-batch on the path `forward_options` picks. Ranks agree
    first on the same decoder forwards (each one all-gathers shards): `agreed_forward_options`."""
    was_training = model.training
    model.eval()
    try:
        micros = list(batch.chunks(micro_batch_size))
        parts = []
        for micro, options in zip(micros, agreed_forward_options(parallel, model, micros, forward_options)):
            with autocast(parallel.device, autocast_dtype):
                lp, _ = micro_logprobs(model, micro, temperature, options, parallel.device)
            parts.append(lp.float())
    finally:
        model.train(was_training)
    return torch.cat(parts).cpu() * batch.response_mask  # one copy to the host, not one per micro-batch


def state_from_folder(folder: Path, prefix: str = "", keep_prefixed: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A Hugging Face folder's weights; names get `prefix` except those of the files in
    `keep_prefixed`, which already carry their module's name (the critic's value head)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise WeightsMismatchError(f"{folder} holds no *.safetensors weights")
    state = {prefix + k: v for k, v in read_safetensors([f for f in files if f.name not in keep_prefixed]).items()}
    state.update(read_safetensors([f for f in files if f.name in keep_prefixed]))
    return state


class WeightsSource(Protocol):
    """What a reference takes the policy's weights from (`load_from`): a worker of this process, or
    the trainer's `protocols.Worker`."""

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...


class ModelWorker(Generic[M]):
    """What every worker has: a model placed by its data-parallel group, and its weights on disk.
    Methods marked collective run on every rank of the group at once; rank 0 writes files."""

    def __init__(self, model: M, parallel: DataParallel):
        self.model = model
        self.parallel = parallel

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def full_state_dict(self) -> dict[str, torch.Tensor]:  # collective
        return self.parallel.full_state_dict(self.model)

    def save_weights(self, folder: Path) -> None:  # collective
        """The model files of a Hugging Face folder (no tokenizer): what resuming loads back."""
        state = self.parallel.full_state_dict(self.model)
        if self.parallel.rank == 0:
            save_hf_weights(self.model, Path(folder), state_dict=state)

    def export_weights(self, folder: Path) -> None:  # collective
        """The model files of a folder `from_pretrained` loads without Ridgeline."""
        self.save_weights(folder)

    def load_weights(self, folder: Path) -> None:  # collective; every rank reads the folder
        self._load_state(self._read_full(Path(folder)), folder)

    def _read_full(self, folder: Path) -> dict[str, torch.Tensor]:
        """The weights `save_weights` wrote to `folder`, under the model's names."""
        return state_from_folder(folder)

    def _load_state(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        try:
            self.parallel.load_full_state_dict(self.model, state)
        except ValueError as err:
            raise WeightsMismatchError(f"{folder} does not fit the model: {err} (was it written by a run with "
                                       "another model?)") from None


class TrainedWorker(ModelWorker[M]):
    """A worker with an optimizer (policy, critic): the end of an optimizer step, the skipped-step
    count, and its weights and optimizer state on disk: with LoRA (`adapters`), checkpoints hold
    what trains and exports the merged model, gathered from the ranks alike."""

    lora_key = "trainer.policy.model.lora"   # the config section of this worker's adapters

    def __init__(self, model: M, optimizer: torch.optim.Optimizer,
                 scheduler: LambdaLR, parallel: DataParallel):
        super().__init__(model, parallel)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.skipped_steps = 0
        # `optimizer_config.offload_after_step` with engines sharing the GPU: AdamW's moments (2x the
        # fp32 weights) wait on the host between steps, so the woken engine has that memory
        self.offload_optimizer = False
        self.adapters = adapter_layout(model)   # where the LoRA adapters sit; None without LoRA

    # -- weights on disk ---------------------------------------------------------------------------
    def save_weights(self, folder: Path) -> None:  # collective; rank 0 writes
        """What resuming loads back: the model files of a Hugging Face folder, or with LoRA only the
        tensors that train (gathered without the frozen base): the adapters as peft writes them
        (`adapter_model.safetensors`, `adapter_config.json`)."""
        if self.adapters is None:
            super().save_weights(folder)
            return
        state = self.parallel.trainable_state_dict(self.model)
        if self.parallel.rank == 0:
            self._write_trained(Path(folder), state)

    def _layout(self) -> AdapterLayout:
        if self.adapters is None:  # callers write or read what trains only with LoRA
            raise RuntimeError(f"{type(self).__name__}: the model has no LoRA adapters")
        return self.adapters

    def _write_trained(self, folder: Path, state: dict[str, torch.Tensor]) -> None:
        self._layout().save(folder, state)

    def _read_trained(self, folder: Path) -> dict[str, torch.Tensor]:
        """The inverse of `_write_trained`: the tensors that train, under the model's names."""
        return self._layout().read(folder, (name for name, _ in self.model.named_parameters()))

    def export_weights(self, folder: Path) -> None:  # collective; rank 0 writes
        """The model files of a folder `from_pretrained` loads without Ridgeline or peft: with LoRA
        the merged weights under the plain model's names."""
        state = self.parallel.full_state_dict(self.model)
        if self.parallel.rank == 0:
            if self.adapters is not None:
                state = dict(self.adapters.merged(state))
            save_hf_weights(plain(self.model), Path(folder), state_dict=state)

    def load_weights(self, folder: Path) -> None:  # collective; every rank reads the folder
        saved_adapters, ours = is_adapter_folder(folder), self.adapters is not None
        if saved_adapters != ours:
            held = "LoRA adapters" if saved_adapters else "full weights (no LoRA)"
            raise WeightsMismatchError(
                f"{folder} holds {held}, but this run has {self.lora_key}.rank {'> 0' if ours else '= 0'}. "
                f"Fix: resume with the run's own {self.lora_key}.* settings, or start afresh "
                "(trainer.resume_mode=none)")
        if not ours:
            super().load_weights(folder)
            return
        try:
            self.parallel.load_trainable_state_dict(self.model, self._read_trained(Path(folder)))
        except ValueError as err:
            raise WeightsMismatchError(f"{err}. Fix: resume with the run's own {self.lora_key}.* settings") from None

    def _optimizer_state_to(self, host: bool) -> None:
        """Move AdamW's state to the host, or back next to each parameter (which under FSDP2's CPU
        offload is the host already)."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state.get(param, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":  # fused AdamW keeps `step` on the host
                        state[key] = value.to("cpu" if host else param.device, non_blocking=True)

    @contextlib.contextmanager
    def optimizer_on_device(self):
        """The optimizer's state where the parameters are for the span of a `train` call; back on
        the host afterwards when `offload_optimizer` is on."""
        if self.offload_optimizer:
            self._optimizer_state_to(host=False)
        try:
            yield
        finally:
            if self.offload_optimizer:
                self._optimizer_state_to(host=True)

    def step_normalizers(self, mini: TrainingBatch, micro_batches: int) -> tuple[float, float, int]:  # collective
        """(tokens, sequences, micro-batches) of this optimizer step: the mini-batch's loss tokens and
        samples (padding rows are neither), which the losses divide by, and the micro-batches whose
        losses add up to it, summed over the ranks (each holds its share)."""
        tokens, sequences, micros = self.parallel.all_sum([float(mini.loss_mask.sum()), float(mini.num_samples),
                                                           float(micro_batches)])
        return tokens, sequences, int(micros)

    def prompt_divisors(self, mini: TrainingBatch, micros: list[TrainingBatch]) -> list[torch.Tensor]:
        """prompt_mean's P * N_p(i) for the rows of each micro-batch: P the mini-batch's prompts (its
        distinct uids), N_p the loss tokens of prompt p's rows in it."""
        if self.parallel.world_size > 1:
            # a prompt's rows may sit on several ranks, and the ranks share sums, not uids
            raise UserError("trainer.algorithm.loss_reduction=prompt_mean is built for one training process; "
                            "with several ranks use token_mean or sequence_mean")
        counts: dict[str, float] = defaultdict(float)
        for uid, row_tokens in zip(mini.uids, mini.loss_mask.sum(-1).tolist()):
            counts[uid] += row_tokens
        return [torch.tensor([len(counts) * counts[uid] for uid in micro.uids]) for micro in micros]

    def all_finite(self, loss_value: float) -> bool:  # collective
        """Whether the loss is finite on EVERY rank, agreed before backward: a rank that skipped its
        backward while the others ran theirs would leave them waiting in the gradient
        reduce-scatter forever."""
        (bad,) = self.parallel.all_max([0.0 if math.isfinite(loss_value) else 1.0])
        return bad == 0.0

    def check_loss(self, loss_value: float, what: str, mode: str) -> bool:  # collective
        """True when the loss is finite on every rank; False (the step is dropped) when not and
        `mode` is skip; NonFiniteLossError when `mode` is stop. Either way a non-finite loss leaves
        no gradient behind (a worker that checks after backward has let it reach them)."""
        if self.all_finite(loss_value):
            return True
        self.optimizer.zero_grad(set_to_none=True)
        if mode == "stop":
            raise NonFiniteLossError(f"{what} is {loss_value} (trainer.nonfinite_loss=stop)")
        return False

    def apply_gradients(self, role: str, max_grad_norm: float, skip_reason: str | None = None) -> float:
        """End an optimizer step: clip the accumulated gradients to `max_grad_norm` (the global norm
        under FSDP2: DTensor reduces it across the mesh), step the optimizer and the schedule, and
        return the grad norm. One bad batch must not poison the weights: with a `skip_reason` (a
        non-finite loss) or a non-finite norm the gradients are dropped, the step counted in
        `skipped_steps` and 0.0 returned; the schedule still advances (the step happened, its
        update was dropped), so it stays on the optimizer-step count it was built for and a
        decaying schedule ends with the run (SkyRL does not advance it on a skipped step). The norm
        is the same on every rank, so ranks agree on skipping."""
        grad_norm = None
        if skip_reason is None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm))
            if math.isfinite(grad_norm):
                self.optimizer.step()
                self.scheduler.step()
                return grad_norm
            skip_reason = f"non-finite grad norm ({grad_norm})"
        self.skipped_steps += 1
        log.warning("%s: %s; optimizer step skipped (%d so far)", role, skip_reason, self.skipped_steps)
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()" is intended here
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        return 0.0

    def rank_rng_states(self) -> list[dict[str, torch.Tensor]]:
        """In one process the run's own generator states are the worker's (the checkpoint's
        rng_state.pt); ranks' states come from their groups (ridgeline.distributed.ray_workers)."""
        return []

    def set_rank_rng_states(self, states: list[dict[str, torch.Tensor]]) -> None:
        if states:
            log.warning("the checkpoint holds the generator states of %d rank(s); this run trains in one process, "
                        "whose states it restores from the run's own", len(states))

    def save_optimizer(self, path: Path) -> None:  # collective; rank 0 writes
        """AdamW state + learning-rate schedule state."""
        state = self.parallel.optimizer_state_dict(self.model, self.optimizer)
        if self.parallel.rank == 0:
            torch.save({"optimizer": state, "scheduler": self.scheduler.state_dict()}, path)

    def load_optimizer(self, path: Path) -> None:  # collective; every rank reads the file
        """Moments, step counts and schedule position from the file; hyperparameters from this
        run's config (`restore_optimizer`)."""
        saved = torch.load(path, map_location="cpu", weights_only=True)

        def load() -> None:
            self.parallel.load_optimizer_state_dict(self.model, self.optimizer, saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
        restore_optimizer(self.optimizer, self.scheduler, load)


@dataclass(frozen=True)
class PolicyTrainConfig:
    # trajectories per optimizer step, all ranks together (policy_mini_batch_size x n_samples_per_prompt):
    # their samples are the mini-batch (TrainingBatch.mini_batches)
    mini_batch_trajectories: int
    micro_batch_size: int           # samples per forward/backward
    micro_forward_batch_size: int   # samples per forward-only pass
    update_epochs: int = 1
    temperature: float = 1.0
    policy_loss: str = "regular"
    loss_reduction: str = "token_mean"
    # the `trainer.algorithm` section (with SkyRL's derived max_seq_len), the policy loss's `config`
    algorithm: LossConfig | None = None
    max_seq_len: int | None = None  # seq_mean_token_sum_norm's constant (None: the padded width)
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


# SkyRL's name for the loss's clip fraction (the other loss metrics keep their own names)
_LOSS_METRIC_NAMES = {"clip_frac": "ppo_clip_ratio"}
# Reported as a sum over micro-batches of losses normalised by global mini-batch counts: each rank
# holds its share and the mini-batch value is the sum over ranks.
_SUMMED = {"policy/policy_loss", "policy/final_loss", "policy/policy_kl"}
# Identical on every rank by construction: the global grad norm, the schedule, the step counts.
_SHARED = {"policy/raw_grad_norm", "policy/policy_lr", "policy/policy_update_steps", "policy/skipped_steps"}


class RefWorker(ModelWorker["MaybeAdapted"]):
    def __init__(self, model: MaybeAdapted, micro_forward_batch_size: int, temperature: float,
                 autocast_dtype: torch.dtype | None, forward_options: ForwardOptions = PLAIN,
                 parallel: DataParallel | None = None):
        super().__init__(model.eval(), parallel or SingleProcess())
        self.model.requires_grad_(False)
        self.micro = micro_forward_batch_size
        self.temperature = temperature
        self.autocast_dtype = autocast_dtype
        self.forward_options = forward_options

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:  # collective
        return batch_logprobs(self.model, batch, self.micro, self.temperature, self.autocast_dtype, self.parallel,
                              self.forward_options)

    def load_from(self, policy: WeightsSource) -> None:  # collective over both groups
        """`update_ref_every_epoch`: the policy's current weights (cast to the reference's dtype)."""
        self.parallel.load_full_state_dict(self.model, policy.full_state_dict())


class BaseModelRefWorker(RefWorker):
    """The reference of a LoRA policy: the policy's own model with its adapters switched off,
    which is the frozen base model it started from. No second copy of the weights exists, and the
    logprobs are those of the base model loaded alone (bit for bit in fp32: a disabled LoRA layer
    runs its base layer only). On FSDP2 every policy rank holds one over its shard of the policy
    (`ridgeline.distributed.ray_workers.RayBaseModelRefGroup`)."""

    def __init__(self, policy: "PolicyWorker", micro_forward_batch_size: int, temperature: float,
                 autocast_dtype: torch.dtype | None, forward_options: ForwardOptions = PLAIN):
        # Not RefWorker.__init__: it would switch the shared model to eval mode and freeze the
        # policy's adapters. batch_logprobs sets (and restores) eval mode around each pass.
        ModelWorker.__init__(self, policy.model, policy.parallel)
        self.micro, self.temperature = micro_forward_batch_size, temperature
        self.autocast_dtype, self.forward_options = autocast_dtype, forward_options

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        with adapters_disabled(self.model):
            return super().compute_logprobs(batch)

    def load_from(self, policy: WeightsSource) -> None:
        raise RuntimeError("a LoRA policy's reference is its frozen base model and cannot take the policy's weights "
                           "(trainer.update_ref_every_epoch=true is refused with trainer.policy.model.lora.rank > 0)")


class PolicyWorker(TrainedWorker["MaybeAdapted"]):
    def __init__(self, model: MaybeAdapted, config: PolicyTrainConfig, optimizer: torch.optim.Optimizer,
                 scheduler: LambdaLR, parallel: DataParallel | None = None):
        super().__init__(model, optimizer, scheduler, parallel or SingleProcess())
        self.config = config
        self.policy_loss_fn = PolicyLoss.bind(config.policy_loss)  # Ridgeline's or SkyRL's convention
        self.profiler: StepProfiler | None = None   # trainer.policy.torch_profiler_config (build_policy_worker)

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:  # collective
        c = self.config
        return batch_logprobs(self.model, batch, c.micro_forward_batch_size, c.temperature, c.autocast_dtype,
                              self.parallel, c.forward_options)

    def engine_weights(self, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """What an engine loads, from this model's full weights `state` (`full_state_dict`): every
        parameter under the plain model's names, tied weights once; with LoRA the merged weights
        W + scaling * B @ A, computed one tensor at a time without touching the training weights
        (ridgeline.models.lora)."""
        layout = self.adapters
        names = {n if layout is None else layout.plain_name(n) for n, _ in self.model.named_parameters()}
        items = state.items() if layout is None else layout.merged(state)
        return ((name, tensor) for name, tensor in items if name in names)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`engine_weights` of this process's model: what an engine in this process takes after an update."""
        return self.engine_weights(self.full_state_dict())

    # -- training ------------------------------------------------------------------------------
    def train(self, batch: TrainingBatch) -> dict[str, float]:  # collective
        """The batch's optimizer steps and their `policy/*` metrics (docs/logging.md), reduced over
        the ranks. SkyRL's: policy_loss (the surrogate, mean over optimizer steps), final_loss (mean
        over micro-batches of what each back-propagated: its share of policy loss + KL term -
        entropy bonus, so about the mini-batch loss / micro-batches per mini-batch, as SkyRL logs
        it), policy_entropy, ppo_clip_ratio, policy_kl (the KL loss term's KL, `use_kl_loss`),
        raw_grad_norm (before clipping), policy_lr, policy_update_steps, and from the engine's
        logprobs rollout_train_prob_diff_mean / _std (of exp(log p_rollout - log p_old) on the loss
        tokens)."""
        if self.profiler is not None:
            self.profiler.begin()
        c = self.config
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        loss_sums: dict[str, float] = {}
        grad_norms: list[float] = []
        minis = batch.mini_batches(c.mini_batch_trajectories)
        with progress(c.update_epochs * len(minis), "train policy") as bar, self.optimizer_on_device():
            for epoch in range(c.update_epochs):
                for mini in minis:
                    grad_norms.append(self._optimizer_step(mini, sums, loss_sums, first_epoch=epoch == 0))
                    bar.update()
        local_tokens = float(batch.loss_mask.sum()) * c.update_epochs
        steps = max(1, len(grad_norms))
        metrics = {
            "policy/policy_loss": sums["policy_loss"] / steps,
            "policy/final_loss": sums["final_loss"] / max(1.0, sums["micro_batches"]),
            "policy/policy_entropy": sums["entropy_tokens"] / max(1.0, local_tokens),
            "policy/raw_grad_norm": sum(grad_norms) / steps,
            "policy/policy_lr": float(self.scheduler.get_last_lr()[0]),
            "policy/policy_update_steps": float(len(grad_norms)),
            "policy/skipped_steps": float(self.skipped_steps),
        }
        # The loss's own metrics: token-weighted means across micro-batches, `*_max` / `*_min` as maxima / minima,
        # `*_sum` as sums (a loss whose metrics are per sequence or pair reports sums and counts)
        for key, value in loss_sums.items():
            name = f"policy/{_LOSS_METRIC_NAMES.get(key, key)}"
            metrics[name] = value if key.endswith(("_max", "_min", "_sum")) else value / max(1.0, local_tokens)
        if c.use_kl_loss:
            metrics["policy/policy_kl"] = sums["kl_loss"] / steps
        summed = _SUMMED | {key for key in metrics if key.endswith("_sum")}
        metrics = reduce_rank_metrics(self.parallel, metrics, local_tokens, prefix="policy/", summed=summed,
                                      shared=_SHARED)
        # how far the engine's numbers are from pi_old: exact over every rank's tokens, from sums
        mismatch_sum, mismatch_tokens, ratio_sum, ratio_sq, ratio_tokens, rollout_kl = self.parallel.all_sum(
            [sums["mismatch_sum"], sums["mismatch_tokens"], sums["ratio_dev_sum"], sums["ratio_dev_sq"],
             sums["ratio_tokens"], sums["rollout_kl"]])
        (worst,) = self.parallel.all_max([sums["mismatch_max"]])
        if mismatch_tokens:
            metrics["rollout/logprob_abs_diff_mean"] = mismatch_sum / mismatch_tokens
            metrics["rollout/logprob_abs_diff_max"] = worst
            metrics["rollout/kl_rollout_trainer"] = rollout_kl / mismatch_tokens
        if ratio_tokens:
            mean, std = ratio_mean_std(ratio_sum, ratio_sq, ratio_tokens)
            metrics["policy/rollout_train_prob_diff_mean"] = mean
            metrics["policy/rollout_train_prob_diff_std"] = std
        if self.profiler is not None:
            self.profiler.step()
        return metrics

    def _optimizer_step(self, mini: TrainingBatch, sums: dict[str, float], loss_sums: dict[str, float],
                        first_epoch: bool) -> float:
        c = self.config
        micros = list(mini.chunks(c.micro_batch_size))
        paths = agreed_forward_options(self.parallel, self.model, micros, c.forward_options)
        self.optimizer.zero_grad(set_to_none=True)
        tokens, sequences, micro_batches = self.step_normalizers(mini, len(micros))
        reported = []
        divisors = self.prompt_divisors(mini, micros) if c.loss_reduction == "prompt_mean" else None
        with loss_normalizers(tokens, sequences, max_seq_len=c.max_seq_len, micro_batches=micro_batches) as norms:
            for index, (micro, options) in enumerate(zip(micros, paths)):
                norms.prompt_divisors = divisors[index] if divisors is not None else None
                reported.append(self._micro_step(micro, options, sums, first_epoch))
        # The micro-batches' own numbers, read from the device once per optimizer step and checked
        # by one all-reduced flag: a check before each backward stalled the device queue and cost an
        # all-reduce per micro-batch. A non-finite loss has reached the gradients by then;
        # `check_loss` drops them, and so the step.
        rows = torch.stack([values for values, _ in reported]).tolist()
        worst = next((row[0] for row in rows if not math.isfinite(row[0])), 0.0)
        if not self.check_loss(worst, "policy loss", c.nonfinite_loss):
            return self.apply_gradients("policy", c.max_grad_norm, "non-finite loss")
        for (loss_value, pg_value, kl_value, entropy_value, tokens), (_, pg_metrics) in zip(rows, reported):
            sums["micro_batches"] += 1
            sums["policy_loss"] += pg_value
            sums["final_loss"] += loss_value
            sums["kl_loss"] += kl_value
            sums["entropy_tokens"] += entropy_value * tokens
            for key, value in pg_metrics.items():
                if key.endswith("_max"):
                    loss_sums[key] = max(loss_sums.get(key, float("-inf")), float(value))
                elif key.endswith("_min"):
                    loss_sums[key] = min(loss_sums.get(key, float("inf")), float(value))
                elif key.endswith("_sum"):
                    loss_sums[key] = loss_sums.get(key, 0.0) + float(value)
                else:
                    loss_sums[key] = loss_sums.get(key, 0.0) + float(value) * tokens
        return self.apply_gradients("policy", c.max_grad_norm)

    def _micro_step(self, micro: TrainingBatch, options: ForwardOptions, sums: dict[str, float],
                    first_epoch: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward and backward of one host micro-batch on the device; the gradient accumulates on
        the parameters. Returns, still on the device, (loss, policy loss, KL loss, entropy mean,
        loss tokens), and the policy loss's metrics."""
        c = self.config
        device = self.parallel.device
        with autocast(device, c.autocast_dtype):
            logprobs, maybe_entropy = micro_logprobs(self.model, micro, c.temperature, options, device,
                                                     with_entropy=True)
        entropy = required(maybe_entropy, "the policy's entropy")
        micro = micro.to(device)
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
            sums["rollout_kl"] += rollout_kl_sum(old, micro.rollout_logprobs, sampled)
            # SkyRL's probability ratio p_rollout / p_old, on the tokens the loss sees
            dev_sum, dev_sq, ratio_count = prob_ratio_moments(old, micro.rollout_logprobs, mask)
            sums["ratio_dev_sum"] += dev_sum
            sums["ratio_dev_sq"] += dev_sq
            sums["ratio_tokens"] += ratio_count
        advantages = required(micro.advantages, "advantages")
        pg_loss, pg_metrics = self.policy_loss_fn(logprobs, old, advantages, mask, c.algorithm,
                                                  rollout_log_probs=micro.rollout_logprobs)
        loss = pg_loss
        kl_loss = None
        if c.use_kl_loss:
            ref = required(micro.ref_logprobs, "reference logprobs (use_kl_loss)")
            kl_loss = reduce_loss(kl_penalty(logprobs, ref, c.kl_estimator), mask, c.loss_reduction)
            loss = loss + c.kl_loss_coef * kl_loss
        if c.use_entropy_loss:
            loss = loss - c.entropy_loss_coef * reduce_loss(entropy, mask, c.loss_reduction)
        entropy_mean = masked_mean(entropy.detach(), mask)
        zero = loss.new_zeros(())
        values = torch.stack([t.detach().float().reshape(()) for t in (
            loss, pg_loss, kl_loss if kl_loss is not None else zero, entropy_mean, mask.sum())])
        loss.backward()
        return values, pg_metrics
