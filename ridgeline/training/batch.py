"""`TrainingBatch`: the named tensors the workers train on, and how a step's batch is cut.

Layout (veRL's): every row is `[prompt | response]` with the prompt LEFT-padded to width P and the
response RIGHT-padded to width R, so all responses start at column P and the per-token tensors
(`response_mask`, `loss_mask`, logprobs, advantages, ...) are `[B, R]` and line up with
`sequences[:, P:]`. Padding is told apart by `attention_mask`, never by the pad id (SmolLM2's pad
token is its eos token).

Where it lives: on the host (CPU). The trainer computes rewards and advantages there, and Ray sends
it through the object store; every worker moves each micro-batch to its own device
(`TrainingBatch.to`) and hands its results back on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Iterator

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
    metadata: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    def select(self, index: slice | torch.Tensor) -> "TrainingBatch":
        """Rows `index` of every per-row field (metadata is shared)."""
        rows = range(self.batch_size)[index] if isinstance(index, slice) else index.tolist()
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                picked[f.name] = value[index]
            elif f.name == "uids":
                picked[f.name] = [value[i] for i in rows]
        return replace(self, **picked)

    def to(self, device: torch.device) -> "TrainingBatch":
        """Every tensor field on `device` (the trainer keeps batches on the host; a worker moves
        each micro-batch to its own device just before computing on it)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def chunks(self, size: int) -> Iterator["TrainingBatch"]:
        for start in range(0, self.batch_size, size):
            yield self.select(slice(start, start + size))


def build_training_batch(prompt_ids: list[list[int]], response_ids: list[list[int]],
                         loss_masks: list[list[int]], rewards: list[float | list[float]], uids: list[str],
                         rollout_logprobs: list[list[float]] | None, pad_id: int) -> TrainingBatch:
    """Pad a generator's output into the [prompt | response] layout. A scalar reward goes on the
    trajectory's last response token; a per-token reward list (multi-turn) is laid out as is."""
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
            if isinstance(rewards[i], list):
                if len(rewards[i]) != len(r):
                    raise ValueError(f"trajectory {i}: {len(rewards[i])} per-token rewards for {len(r)} response tokens")
                token_rewards[i, :len(r)] = torch.tensor(rewards[i], dtype=torch.float)
            else:
                token_rewards[i, len(r) - 1] = rewards[i]
            if logprobs is not None:
                logprobs[i, :len(r)] = torch.tensor(rollout_logprobs[i])
    return TrainingBatch(sequences=sequences, attention_mask=attention, response_mask=response_mask,
                         loss_mask=loss_mask, rewards=token_rewards, uids=list(uids),
                         rollout_logprobs=logprobs, sampled_mask=loss_mask.clone())


def data_parallel_rows(batch_size: int, mini_batch_size: int, world_size: int) -> int:
    """How many leading rows of a batch `world_size` data-parallel ranks can train: every
    mini-batch of `mini_batch_size` rows (the last may be shorter) must split into equal rank
    shares. Validation makes full mini-batches divisible; only a short last mini-batch (a short
    dynamic-sampling batch) can lose up to `world_size - 1` rows."""
    full, rest = divmod(batch_size, mini_batch_size)
    return full * mini_batch_size + rest - rest % world_size


def rank_rows(batch_size: int, mini_batch_size: int, world_size: int) -> list[torch.Tensor]:
    """Row indices of each rank: its contiguous 1/world_size share of every mini-batch, in order,
    so rank r's k-th mini-batch of `mini_batch_size / world_size` rows is its share of the k-th
    global one (what FSDP's global loss normalisers assume). `batch_size` must be
    `data_parallel_rows(...)` of itself."""
    if data_parallel_rows(batch_size, mini_batch_size, world_size) != batch_size:
        raise ValueError(f"{batch_size} rows in mini-batches of {mini_batch_size} do not split over "
                         f"{world_size} ranks")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for start in range(0, batch_size, mini_batch_size):
        size = min(mini_batch_size, batch_size - start)
        per = size // world_size
        for r in range(world_size):
            shares[r].extend(range(start + r * per, start + (r + 1) * per))
    return [torch.tensor(s, dtype=torch.long) for s in shares]
