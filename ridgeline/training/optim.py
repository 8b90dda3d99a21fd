"""AdamW with a linear warmup to a constant learning rate (SkyRL's default schedule)."""

from __future__ import annotations

from typing import Callable

import torch


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


def build_scheduler(optimizer: torch.optim.Optimizer, num_warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """lr * min(1, (step + 1) / warmup): the first optimizer step already trains (at lr/warmup)."""
    def factor(step: int) -> float:
        return 1.0 if num_warmup_steps <= 0 else min(1.0, (step + 1) / num_warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def restore_optimizer(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                      load_states: Callable[[], None]) -> None:
    """Resume an optimizer and its schedule: `load_states()` loads the saved moments, step counts
    and schedule position (however the worker stores them: plain or sharded); the
    hyperparameters (lr, betas, weight decay, warmup) are then put back from this run's config, so
    a changed learning rate takes effect. Unchanged, the values are exactly the saved ones."""
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
