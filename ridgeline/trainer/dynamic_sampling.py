"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476): keep only prompt groups whose
rewards differ, because a group whose samples all score the same has zero group-relative
advantage and only dilutes the batch.

`trainer.algorithm.dynamic_sampling.type`:

* `filter`: drop signal-less groups and generate further batches of prompts (up to
  `max_sample_batches` batches in all) until `train_batch_size` groups with signal are collected;
  the surplus of the last batch is cut off.
* `replace`: one batch; if at least `min_replace_ratio` of its groups carry signal, every
  signal-less group is replaced by a copy of a randomly chosen group with signal; otherwise the
  batch is trained as it is.

The functions here decide which rows to keep; the trainer does the generating.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from ridgeline.generation.types import GeneratorOutput, Reward, total_reward


def group_rows(uids: Sequence[str]) -> dict[str, list[int]]:
    """uid -> its row indices, groups in order of first appearance."""
    groups: dict[str, list[int]] = defaultdict(list)
    for row, uid in enumerate(uids):
        groups[uid].append(row)
    return dict(groups)


def signal_groups(uids: Sequence[str], rewards: Sequence[Reward], tol: float = 0.0) -> list[str]:
    """Groups (in order) with at least two samples whose returns are not all equal (more than `tol`
    apart: the largest minus the smallest)."""
    out = []
    for uid, rows in group_rows(uids).items():
        returns = [total_reward(rewards[r]) for r in rows]
        if len(rows) > 1 and max(returns) - min(returns) > tol:
            out.append(uid)
    return out


def num_groups(out: GeneratorOutput) -> int:
    return len(set(out.uids))


def keep_groups(out: GeneratorOutput, keep: Sequence[str]) -> GeneratorOutput:
    """The rows of these groups, group after group in the order of `keep`."""
    rows_of = group_rows(out.uids)
    return out.select([r for uid in keep for r in rows_of[uid]])


def filter_rollout(out: GeneratorOutput) -> GeneratorOutput:
    """The groups of `out` that carry signal."""
    return keep_groups(out, signal_groups(out.uids, out.rewards))


def mask_signal_less_groups(out: GeneratorOutput, tol: float = 0.0) -> int:
    """SkyRL's `trainer.algorithm.zero_variance_filter`: every row of a group (two samples or more)
    whose returns are all equal gets loss mask 0, in place; returns how many rows. Such a group has
    zero group-relative advantage, but a KL or entropy term would still move the policy on it.
    SkyRL applies it to single-turn rewards only; here a multi-turn row's return counts the same."""
    signal = set(signal_groups(out.uids, out.rewards, tol))
    masked = [r for uid, rows in group_rows(out.uids).items() if len(rows) > 1 and uid not in signal for r in rows]
    for row in masked:
        out.loss_masks[row] = [0] * len(out.loss_masks[row])
    return len(masked)


def replace_rollout(out: GeneratorOutput, min_replace_ratio: float,
                    rng: random.Random) -> tuple[GeneratorOutput, int]:
    """Replace signal-less groups by copies of random groups with signal, when at least
    `min_replace_ratio` of the groups have signal. Returns the rollout and how many groups were
    replaced (0 when too few groups had signal: the batch is returned as it is).

    A copy gets a fresh uid (`<uid>#copy<k>`) so it forms a group of its own: its advantages equal
    those of the original, so in effect the original group counts twice.
    """
    good = signal_groups(out.uids, out.rewards)
    rows_of = group_rows(out.uids)
    good_set = set(good)
    bad = [uid for uid in rows_of if uid not in good_set]
    if not bad or not good or len(good) < min_replace_ratio * len(rows_of):
        return out, 0
    rows: list[int] = []
    renamed: dict[int, str] = {}   # position in the result -> the copy's uid
    copies = 0
    for uid in rows_of:
        if uid in good_set:
            rows += rows_of[uid]
            continue
        source = rng.choice(good)
        copies += 1
        renamed.update({len(rows) + k: f"{source}#copy{copies}" for k in range(len(rows_of[source]))})
        rows += rows_of[source]
    picked = out.select(rows)
    picked.trajectory_ids = [replace(tid, uid=renamed[pos]) if pos in renamed else tid
                             for pos, tid in enumerate(picked.trajectory_ids)]
    return picked, copies


def first_groups(out: GeneratorOutput, count: int) -> GeneratorOutput:
    """The first `count` groups (the cut of a `filter` batch that overshot its target)."""
    return keep_groups(out, list(group_rows(out.uids))[:count])
