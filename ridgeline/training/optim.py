"""AdamW with a linear warmup to a constant learning rate (SkyRL's default schedule)."""

from __future__ import annotations

import torch


def build_optimizer(model: torch.nn.Module, lr: float, betas: tuple[float, float],
                    weight_decay: float) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, num_warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """lr * min(1, (step + 1) / warmup): the first optimizer step already trains (at lr/warmup)."""
    def factor(step: int) -> float:
        return 1.0 if num_warmup_steps <= 0 else min(1.0, (step + 1) / num_warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
