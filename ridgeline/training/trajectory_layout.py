"""A batch's per-token tensors laid out one row per trajectory, and back.

With step-wise training a trajectory is several samples (one per turn), but its advantage is a
property of the whole trajectory. `TrajectoryLayout.of(batch)` places the response tokens of each
trajectory's samples side by side, in turn order, in one row of a `[T, L]` tensor (T trajectories,
L the most tokens any trajectory has); an advantage estimator runs on that as on any batch (groups
by the trajectories' uids), and `scatter` puts its results back on every sample's own tokens.

So each step gets exactly the advantage its tokens have in the whole trajectory: for the outcome
estimators (grpo, rloo) the trajectory's scalar on every token of every step; for gae /
reinforce++ the return-to-go through the later turns' rewards and (gae) values. With one sample
per trajectory the layout is the batch itself, so both modes take this one path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ridgeline.training.batch import TrainingBatch


@dataclass(frozen=True)
class TrajectoryLayout:
    uids: list[str]     # [T] the group (prompt) id of each trajectory
    mask: Tensor        # [T, L] 1 on the trajectory's response tokens (all its samples'), left-aligned
    rows: Tensor        # [N] batch row of every response token of the batch (row-major order)
    cols: Tensor        # [N] its column in the batch
    trajectory: Tensor  # [N] its trajectory
    position: Tensor    # [N] its column in the trajectory's row
    batch_shape: tuple[int, int]

    @classmethod
    def of(cls, batch: TrainingBatch) -> "TrajectoryLayout":
        """The layout of `batch` (a driver's batch: no padding rows), whose samples' response masks
        are contiguous from column 0 and whose trajectories are numbered 0..T-1 in row order."""
        index = batch.trajectories()
        count = int(index[-1]) + 1 if index.numel() else 0
        if not torch.equal(torch.unique_consecutive(index), torch.arange(count)):
            raise ValueError("TrajectoryLayout: the batch's trajectory_index must number trajectories 0..T-1 in row "
                             f"order, got {index.tolist()}")
        lengths = batch.response_mask.sum(-1).long()
        before = torch.cumsum(lengths, 0) - lengths             # response tokens of the rows above
        first = torch.zeros(count, dtype=torch.long).scatter_reduce(0, index, before, "amin", include_self=False)
        offset = before - first[index]                          # tokens of the same trajectory's earlier samples
        rows, cols = batch.response_mask.nonzero(as_tuple=True)
        trajectory, position = index[rows], cols + offset[rows]
        totals = torch.zeros(count, dtype=torch.long).index_add_(0, index, lengths)
        width = max(1, int(totals.max())) if count else 1
        mask = torch.zeros(count, width)
        mask[trajectory, position] = 1.0
        starts = torch.cumsum(torch.bincount(index, minlength=count), 0) - torch.bincount(index, minlength=count)
        uids = [batch.uids[int(r)] for r in starts]
        samples, width = batch.response_mask.shape
        return cls(uids, mask, rows, cols, trajectory, position, (samples, width))

    def gather(self, per_token: Tensor) -> Tensor:
        """A batch tensor [B, R] -> [T, L] (zero outside the response tokens)."""
        out = torch.zeros(self.mask.shape, dtype=per_token.dtype)
        out[self.trajectory, self.position] = per_token[self.rows, self.cols]
        return out

    def scatter(self, per_token: Tensor) -> Tensor:
        """A trajectory tensor [T, L] -> [B, R]: each sample's tokens get their trajectory's values."""
        out = torch.zeros(self.batch_shape, dtype=per_token.dtype)
        out[self.rows, self.cols] = per_token[self.trajectory, self.position]
        return out


__all__ = ["TrajectoryLayout"]
