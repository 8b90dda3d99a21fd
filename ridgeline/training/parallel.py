"""The data-parallel group a worker trains in. One process is a world of one (`SingleProcess`);
FSDP2 ranks are `ridgeline.distributed.fsdp.FSDPGroup`. The workers are one code for both: every
place where ranks must agree (loss normalisers, finiteness, forward counts, metrics) is an
all-reduce through this seam, which in a world of one returns its input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from ridgeline.models.loading import load_state_into

M = TypeVar("M", bound=nn.Module)


class DataParallel(Protocol):
    """Where a worker's model lives and how its ranks talk. Methods marked collective must be
    called on every rank of the group at once."""

    # read-only: a rank's place is fixed (FSDPGroup reads it from torch.distributed)
    @property
    def device(self) -> torch.device:
        """Where the worker computes (cuda:LOCAL_RANK on a GPU rank)."""
        ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_sum(self, values: list[float]) -> list[float]:
        """Collective: the element-wise sum over ranks (float64)."""
        ...

    def all_max(self, values: list[float]) -> list[float]:
        """Collective: the element-wise maximum over ranks (float64)."""
        ...

    def place(self, model: M) -> M:
        """Collective: the model on this group's device (sharded over the ranks by FSDP2). Called
        before the optimizer is built, which must hold the placed parameters."""
        ...

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Collective: the full (unsharded) weights, keys of the unsharded model's state dict, on
        rank 0; an empty dict on the others."""
        ...

    def load_full_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Collective: load full weights (every rank passes the same) into the placed model."""
        ...

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Collective: the full tensors of the parameters that train (LoRA adapters, a LoRA
        critic's value head), keyed as in the model's state dict, on rank 0 (host memory under
        FSDP2); an empty dict on the others. Gathers only those, not the frozen base."""
        ...

    def load_trainable_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Collective: the inverse of `trainable_state_dict` (every rank passes the same), in place;
        ValueError unless `state` names exactly the parameters that train."""
        ...

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Collective: the optimizer's state in a form `load_optimizer_state_dict` takes back, on
        rank 0 (full, world-size free under FSDP2)."""
        ...

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        """Collective: the inverse of `optimizer_state_dict` (every rank passes the same)."""
        ...


@dataclass(frozen=True)
class SingleProcess:
    """A world of one on `device`: the reductions return their input, weights are the model's own."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    world_size: int = 1

    def all_sum(self, values: list[float]) -> list[float]:
        return list(values)

    def all_max(self, values: list[float]) -> list[float]:
        return list(values)

    def place(self, model: M) -> M:
        return model.to(self.device)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def load_full_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        load_state_into(model, state)

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        check_trainable_names(model, state)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)


def check_trainable_names(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """ValueError unless `state` names exactly `model`'s parameters that train."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(state) != trainable:
        raise ValueError(f"missing {sorted(trainable - set(state))[:3]}, unexpected {sorted(set(state) - trainable)[:3]}")


def check_uniform_forwards(parallel: DataParallel, passes: list[int]) -> None:
    """Collective: raise RuntimeError on every rank unless all ranks will run the same decoder
    forwards (`passes`: forwards per micro-batch, in order). Under FSDP2 each forward all-gathers
    the sharded layers, so a rank running one forward more than its peers would wait forever; the
    check turns that hang into an error. A world of one always passes."""
    counts = parallel.all_max([float(len(passes)), -float(len(passes))])
    if counts[0] != -counts[1]:
        raise RuntimeError(f"data-parallel ranks hold different numbers of micro-batches ({int(-counts[1])} to "
                           f"{int(counts[0])}); every rank must hold the same number of rows")
    if not passes:
        return
    both = parallel.all_max([float(p) for p in passes] + [-float(p) for p in passes])
    if both[:len(passes)] != [-x for x in both[len(passes):]]:
        raise RuntimeError("data-parallel ranks disagree on the shared-prompt forward path of a micro-batch (rows "
                           "sharing a prompt on some ranks, not on others); keep GRPO groups whole within each "
                           "rank's micro-batches, or give every rank the same grouping")


def reduce_rank_metrics(parallel: DataParallel, metrics: dict[str, float], local_tokens: float, *, prefix: str,
                        summed: set[str], shared: set[str]) -> dict[str, float]:
    """Collective: a worker's metrics on one rank -> the whole data-parallel batch's. Keys in
    `shared` are equal on every rank already; keys in `summed` are losses normalised by
    mini-batch-global counts (each rank holds its share: sum them); other `<prefix>*` keys are
    token-weighted means over the rank's `local_tokens` (re-weighted by global tokens); `*_max`
    are maxima, `*_min` minima; anything else is averaged over ranks. Every rank must report the same keys. In a
    world of one the metrics come back as they are."""
    if parallel.world_size == 1:
        return dict(metrics)
    weight = max(1.0, local_tokens)
    keys = sorted(k for k in metrics if k not in shared)
    sums, maxes = [], []
    for key in keys:
        if key.endswith("_max"):
            maxes.append(metrics[key])
        elif key.endswith("_min"):
            maxes.append(-metrics[key])   # the min over ranks is minus the max of the negated values
        elif key in summed or not key.startswith(prefix):
            sums.append(metrics[key])
        else:
            sums.append(metrics[key] * weight)
    sums = parallel.all_sum(sums + [local_tokens])
    maxes = parallel.all_max(maxes)
    global_tokens = sums[-1]
    out = dict(metrics)
    s, m = iter(sums), iter(maxes)
    for key in keys:
        if key.endswith("_max"):
            out[key] = next(m)
        elif key.endswith("_min"):
            out[key] = -next(m)
        elif key in summed:
            out[key] = next(s)
        elif key.startswith(prefix):
            out[key] = next(s) / max(1.0, global_tokens)
        else:
            out[key] = next(s) / parallel.world_size
    return out
