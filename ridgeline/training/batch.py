"""`TrainingBatch`: the named tensors the workers train on, and how a step's batch is cut.

Layout (veRL's): every row is `[prompt | response]` with the prompt LEFT-padded to width P and the
response RIGHT-padded to width R, so all responses start at column P and the per-token tensors
(`response_mask`, `loss_mask`, logprobs, advantages, ...) are `[B, R]` and line up with
`sequences[:, P:]`. Padding is told apart by `attention_mask`, never by the pad id (SmolLM2's pad
token is its eos token).

Rows are samples: a whole trajectory, or with step-wise training one turn of it
(`trajectory_index` says which trajectory; a trajectory's rows are consecutive). Mini-batches are
cut by trajectories, not rows (`mini_batches`), so an optimizer step takes the same trajectories
whatever number of steps they have. On FSDP2 ranks a mini-batch is padded to a multiple of the
ranks (`rank_shares`) with rows marked `is_padding`: masked out of every loss and count.

Where it lives: on the host (CPU). The trainer computes rewards and advantages there, and Ray sends
it through the object store; every worker moves each micro-batch to its own device
(`TrainingBatch.to`) and hands its results back on the host.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator

import torch


@dataclass
class TrainingBatch:
    sequences: torch.Tensor        # [B, P+R] long
    attention_mask: torch.Tensor   # [B, P+R] long: 1 on real tokens
    response_mask: torch.Tensor    # [B, R] float: 1 on generated tokens
    loss_mask: torch.Tensor        # [B, R] float: 1 where the token counts in the loss
    rewards: torch.Tensor          # [B, R] float: token-level rewards (outcome reward on the last token)
    uids: list[str]                # [B] prompt id: rows with the same uid form a GRPO group
    rollout_logprobs: torch.Tensor | None = None  # [B, R] from the engine
    sampled_mask: torch.Tensor | None = None      # [B, R] 1 on tokens the engine sampled (not observations)
    old_logprobs: torch.Tensor | None = None      # [B, R] policy before this step's updates
    ref_logprobs: torch.Tensor | None = None      # [B, R]
    advantages: torch.Tensor | None = None        # [B, R]
    returns: torch.Tensor | None = None           # [B, R]
    values: torch.Tensor | None = None            # [B, R] critic values before this step's updates
    # [B] long: the trajectory (0..T-1, ascending) each row is a sample of; build_training_batch sets it
    trajectory_index: torch.Tensor | None = None
    is_padding: torch.Tensor | None = None        # [B] bool: a rank's padding row (rank_shares), no loss
    metadata: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    @property
    def num_samples(self) -> int:
        """Rows that are samples (not a rank's padding): what per-sequence losses divide by."""
        return self.batch_size - (int(self.is_padding.sum()) if self.is_padding is not None else 0)

    def trajectories(self) -> torch.Tensor:
        """[B] the trajectory of each row (row i is trajectory i when none was set)."""
        return self.trajectory_index if self.trajectory_index is not None else torch.arange(self.batch_size)

    def mini_batches(self, trajectories: int) -> list["TrainingBatch"]:
        """The optimizer steps' mini-batches, in order: the rows of each run of `trajectories`
        trajectories (trajectory index // trajectories); with one row per trajectory these are
        `chunks(trajectories)`. A rank's share keeps the global indices, so its k-th mini-batch is
        its share of the k-th global one."""
        _, sizes = torch.unique_consecutive(self.trajectories() // trajectories, return_counts=True)
        starts = [0, *torch.cumsum(sizes, 0).tolist()]
        return [self.select(slice(a, b)) for a, b in zip(starts, starts[1:])]

    def share(self, share: "RankShare") -> "TrainingBatch":
        """A rank's rows; its padding rows are masked out of every loss, metric and count."""
        part = self.select(share.rows)
        if not bool(share.padding.any()):
            return part
        keep = (~share.padding).float().unsqueeze(-1)
        part.loss_mask = part.loss_mask * keep
        part.response_mask = part.response_mask * keep
        part.rewards = part.rewards * keep
        if part.sampled_mask is not None:
            part.sampled_mask = part.sampled_mask * keep
        part.is_padding = share.padding.clone()
        return part

    def select(self, index: slice | torch.Tensor) -> "TrainingBatch":
        """Rows `index` of every per-row field (metadata is shared)."""
        rows = range(self.batch_size)[index] if isinstance(index, slice) else index.tolist()
        picked = self._map_tensors(lambda t: t[index])
        picked.uids = [self.uids[i] for i in rows]
        return picked

    def to(self, device: torch.device) -> "TrainingBatch":
        """Every tensor field on `device` (the trainer keeps batches on the host; a worker moves
        each micro-batch to its own device just before computing on it)."""
        return self._map_tensors(lambda t: t.to(device))

    def _map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "TrainingBatch":
        """A shallow copy with `fn` of every tensor field (the others shared)."""
        out = copy.copy(self)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(out, f.name, fn(value))
        return out

    def chunks(self, size: int) -> Iterator["TrainingBatch"]:
        for start in range(0, self.batch_size, size):
            yield self.select(slice(start, start + size))


def required(value: torch.Tensor | None, what: str) -> torch.Tensor:
    """A field an earlier phase of the step fills (`what` names it); RuntimeError if it did not run."""
    if value is None:
        raise RuntimeError(f"the training batch lacks {what}: the step phase that computes it did not run")
    return value


def build_training_batch(prompt_ids: list[list[int]], response_ids: list[list[int]],
                         loss_masks: list[list[int]], rewards: list[float | list[float]], uids: list[str],
                         rollout_logprobs: list[list[float]] | None, pad_id: int,
                         trajectory_index: list[int] | None = None) -> TrainingBatch:
    """Pad samples into the [prompt | response] layout. A scalar reward goes on the sample's last
    response token; a per-token reward list (multi-turn) is laid out as is. `trajectory_index`:
    the trajectory each sample belongs to (ascending; default: one sample per trajectory)."""
    batch = len(prompt_ids)
    width_p = max(len(p) for p in prompt_ids)
    width_r = max(1, max(len(r) for r in response_ids))
    sequences = torch.full((batch, width_p + width_r), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width_p + width_r), dtype=torch.long)
    response_mask = torch.zeros((batch, width_r))
    loss_mask = torch.zeros((batch, width_r))
    token_rewards = torch.zeros((batch, width_r))
    logprobs = torch.zeros((batch, width_r)) if rollout_logprobs is not None else None
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        sequences[i, width_p - len(p):width_p] = torch.tensor(p, dtype=torch.long)
        attention[i, width_p - len(p):width_p] = 1
        if r:
            sequences[i, width_p:width_p + len(r)] = torch.tensor(r, dtype=torch.long)
            attention[i, width_p:width_p + len(r)] = 1
            response_mask[i, :len(r)] = 1
            loss_mask[i, :len(r)] = torch.tensor(loss_masks[i], dtype=torch.float)
            reward = rewards[i]
            if isinstance(reward, list):
                if len(reward) != len(r):
                    raise ValueError(f"trajectory {i}: {len(reward)} per-token rewards for {len(r)} response tokens")
                token_rewards[i, :len(r)] = torch.tensor(reward, dtype=torch.float)
            else:
                token_rewards[i, len(r) - 1] = reward
            if logprobs is not None and rollout_logprobs is not None:
                logprobs[i, :len(r)] = torch.tensor(rollout_logprobs[i])
    index = torch.tensor(list(trajectory_index) if trajectory_index is not None else list(range(batch)), dtype=torch.long)
    if index.numel() != batch or bool((index[1:] < index[:-1]).any()):
        raise ValueError(f"trajectory_index must give each of the {batch} samples its trajectory, in ascending order")
    return TrainingBatch(sequences=sequences, attention_mask=attention, response_mask=response_mask,
                         loss_mask=loss_mask, rewards=token_rewards, uids=list(uids),
                         rollout_logprobs=logprobs, sampled_mask=loss_mask.clone(), trajectory_index=index)


@dataclass(frozen=True)
class RankShare:
    """One data-parallel rank's rows of a batch (`TrainingBatch.share` makes its part)."""
    rows: torch.Tensor     # [n] long, batch rows; a padding row repeats the last row of its mini-batch
    padding: torch.Tensor  # [n] bool


def rank_shares(trajectories: torch.Tensor, mini_batch_trajectories: int, world_size: int) -> list[RankShare]:
    """Each rank's contiguous 1/world_size share of every mini-batch, in order (what the global
    loss normalisers of `ridgeline.distributed.fsdp` assume). `trajectories`: the batch's
    `trajectories()`. A mini-batch whose row count does not divide by `world_size` (step-wise
    samples, a short dynamic-sampling batch) is first padded with copies of its last row, marked
    as padding: every rank then runs the same forwards, and the padding trains nothing."""
    _, sizes = torch.unique_consecutive(trajectories // mini_batch_trajectories, return_counts=True)
    rows: list[list[int]] = [[] for _ in range(world_size)]
    padding: list[list[bool]] = [[] for _ in range(world_size)]
    start = 0
    for size in sizes.tolist():
        extra = -size % world_size
        mini = list(range(start, start + size)) + [start + size - 1] * extra
        flags = [False] * size + [True] * extra
        per = len(mini) // world_size
        for r in range(world_size):
            rows[r] += mini[r * per:(r + 1) * per]
            padding[r] += flags[r * per:(r + 1) * per]
        start += size
    return [RankShare(torch.tensor(r, dtype=torch.long), torch.tensor(p, dtype=torch.bool))
            for r, p in zip(rows, padding)]
