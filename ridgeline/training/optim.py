"""AdamW and its learning-rate schedule: transformers' schedules by name, as SkyRL builds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

# transformers' schedule names that need nothing but warmup and training steps (`get_scheduler`
# with its defaults: polynomial ends at lr_end=1e-7 with power 1, cosine_with_restarts has one cycle,
# inverse_sqrt's timescale is the warmup, or 10,000 steps without one)
LR_SCHEDULES: tuple[str, ...] = (
    "constant_with_warmup", "constant", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt",
)
# the other names transformers knows, and what each would need that SkyRL 0.3.1 does not pass either
UNBUILT_LR_SCHEDULES: dict[str, str] = {
    "reduce_lr_on_plateau": "a metric to step on",
    "greedy": "a metric to step on",
    "cosine_with_min_lr": "min_lr or min_lr_rate",
    "cosine_warmup_with_min_lr": "min_lr or min_lr_rate",
    "warmup_stable_decay": "num_decay_steps",
}
POLYNOMIAL_LR_END = 1e-7  # transformers' default end of the polynomial schedule: lr must exceed it


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in two groups: matrices (linear and embedding weights) decay, vectors
    (biases, norm scales) do not: the split of SkyRL, OpenRLHF and transformers' Trainer, by shape
    rather than by name so it holds for any architecture. Empty groups are left out."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def fused_adamw_supported(model: torch.nn.Module) -> bool:
    """torch's fused AdamW kernel (one kernel per step instead of ~10 elementwise passes per
    tensor: 0.12 s against 0.69 s per step for SmolLM2-135M on one CPU core) takes floating-point
    parameters on CPU and CUDA."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices
    devices = set(_get_fused_kernels_supported_devices())
    return all(p.device.type in devices and p.is_floating_point() for p in model.parameters() if p.requires_grad)


def build_optimizer(model: torch.nn.Module, lr: float, betas: tuple[float, float],
                    weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas,
                             fused=fused_adamw_supported(model) or None)


@dataclass(frozen=True)
class LRSchedule:
    """One model's learning-rate schedule, counted in optimizer steps."""

    name: str                 # one of LR_SCHEDULES
    num_warmup_steps: int
    num_training_steps: int   # optimizer steps of the whole run (where linear, cosine, ... reach their end)


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> LambdaLR:
    """transformers' `get_scheduler(name, optimizer, num_warmup_steps, num_training_steps)`, the call
    SkyRL makes, stepped once per optimizer step. Its warmup factor is step / warmup from step 0, so
    with a warmup the first optimizer step trains at lr 0 (it only fills AdamW's moments), the
    second at lr / warmup, and the full lr is reached at step `warmup` (SkyRL's learning rates,
    step for step)."""
    from transformers import get_scheduler

    if schedule.name not in LR_SCHEDULES:
        raise ValueError(f"learning-rate schedule {schedule.name!r} is not built; built: {', '.join(LR_SCHEDULES)}")
    scheduler = get_scheduler(schedule.name, optimizer, num_warmup_steps=schedule.num_warmup_steps,
                              num_training_steps=schedule.num_training_steps)
    if not isinstance(scheduler, LambdaLR):  # restore_optimizer recomputes learning rates from its lambdas
        raise TypeError(f"transformers built a {type(scheduler).__name__} for {schedule.name!r}, not a LambdaLR")
    return scheduler


def restore_optimizer(optimizer: torch.optim.Optimizer, scheduler: LambdaLR,
                      load_states: Callable[[], None]) -> None:
    """Resume an optimizer and its schedule: `load_states()` loads the saved moments, step counts
    and schedule position (however the worker stores them: plain or sharded); the
    hyperparameters (lr, betas, weight decay) and the schedule (its name, warmup and length) are
    then this run's, so a changed learning rate takes effect. Unchanged, the values are exactly the
    saved ones."""
    fresh = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    load_states()
    scheduler.base_lrs = base_lrs
    lrs = [base * fn(scheduler.last_epoch) for fn, base in zip(scheduler.lr_lambdas, base_lrs)]
    for group, hyper, base, lr in zip(optimizer.param_groups, fresh, base_lrs, lrs):
        group.update(hyper)
        group["initial_lr"] = base
        group["lr"] = lr
    scheduler._last_lr = list(lrs)
