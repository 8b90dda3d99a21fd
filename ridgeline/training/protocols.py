"""The seams between the trainer loop and its workers: what a policy, a reference and a critic
answer, whether they live in this process (ridgeline.training.worker, critic_worker: a world of
one) or are groups of FSDP2 ranks on Ray (ridgeline.distributed.ray_workers). The trainer, the
checkpointer and the weight sync speak only these protocols.

Batches go in and per-token results come back on the host; each implementation computes on its
own devices. Weights and optimizer states on disk are world-size free: a checkpoint written by N
ranks loads into M ranks of the same strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ridgeline.training.batch import TrainingBatch
from ridgeline.training.worker import PolicyTrainConfig


class Worker(Protocol):
    """The policy: logprobs, optimizer steps, its weights and optimizer on disk."""

    config: PolicyTrainConfig
    skipped_steps: int   # optimizer steps dropped for a non-finite loss or grad norm, over the run

    @property
    def world_size(self) -> int:
        """Data-parallel ranks sharing each mini-batch (1 in one process)."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) weights, keys of the model's state dict (what a reference loads)."""
        ...

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        """`[B, R]` logprobs of the batch's responses, zero outside the response mask."""
        ...

    def train(self, batch: TrainingBatch) -> dict[str, float]:
        """The batch's optimizer steps; the `policy/*` metrics of the whole batch."""
        ...

    def save_weights(self, folder: Path) -> None:
        """What resuming needs (a Hugging Face model folder, or LoRA adapters), tokenizer aside."""
        ...

    def export_weights(self, folder: Path) -> None:
        """A model folder plain transformers loads (LoRA merged), tokenizer aside."""
        ...

    def load_weights(self, folder: Path) -> None:
        """The inverse of `save_weights`; `WeightsMismatchError` when the files do not fit."""
        ...

    def save_optimizer(self, path: Path) -> None: ...

    def load_optimizer(self, path: Path) -> None: ...

    def rank_rng_states(self) -> list[dict[str, torch.Tensor]]:
        """The generator states of the processes the worker's ranks run in (FSDP2 on Ray: one per
        rank, torch CPU and CUDA), for checkpoints; [] in one process, whose states are the run's own."""
        ...

    def set_rank_rng_states(self, states: list[dict[str, torch.Tensor]]) -> None:
        """The inverse of `rank_rng_states` (a checkpoint of another rank count: left at their seeds, logged)."""
        ...


class ReferenceWorker(Protocol):
    """The frozen reference: logprobs, and the policy's weights after an epoch
    (`update_ref_every_epoch`)."""

    @property
    def world_size(self) -> int: ...

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor: ...

    def load_from(self, policy: Worker) -> None: ...

    def save_weights(self, folder: Path) -> None: ...

    def load_weights(self, folder: Path) -> None: ...


class ValueWorker(Protocol):
    """The critic: values, optimizer steps, its weights (backbone + value head) and optimizer."""

    skipped_steps: int

    @property
    def world_size(self) -> int: ...

    def compute_values(self, batch: TrainingBatch) -> torch.Tensor:
        """`[B, R]` float32 values of the states before each response token, zero outside the mask."""
        ...

    def train(self, batch: TrainingBatch) -> dict[str, float]: ...

    def save_weights(self, folder: Path) -> None: ...

    def export_weights(self, folder: Path) -> None: ...

    def load_weights(self, folder: Path) -> None: ...

    def save_optimizer(self, path: Path) -> None: ...

    def load_optimizer(self, path: Path) -> None: ...

    def rank_rng_states(self) -> list[dict[str, torch.Tensor]]: ...

    def set_rank_rng_states(self, states: list[dict[str, torch.Tensor]]) -> None: ...


@dataclass
class Workers:
    """The models of a run: the policy always, a reference with a KL term, a critic for GAE."""

    policy: Worker
    ref: ReferenceWorker | None = None
    critic: ValueWorker | None = None
