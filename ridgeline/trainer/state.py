"""What a run carries from step to step besides the weights: the trainer owns it, checkpoints
write and restore it (ridgeline.trainer.checkpoint), nothing else reaches into the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

from ridgeline.algorithms.kl_control import KLController
from ridgeline.algorithms.reward_shaping import RunningRewardStd
from ridgeline.trainer.scheduled import ScheduledBatch


@dataclass
class AlgorithmState:
    """The algorithm's own running state."""

    kl_controller: KLController | None = None   # use_kl_in_reward
    reward_std: RunningRewardStd | None = None    # normalize_reward with a critic


@dataclass
class RunState:
    """The step loop's position and identity."""

    run_id: str                                   # the trackers' run id, kept across resumes
    global_step: int = 0                          # steps trained so far
    data_position: tuple[int, int] = (0, 0)       # (epoch, batch within it) of the next step
    ref_updated: bool = False                     # the reference is no longer the initial model
    algorithm: AlgorithmState = field(default_factory=AlgorithmState)
    # asynchronous modes: the batches of the next steps, generated but not yet trained on (a
    # checkpoint keeps them, so a resumed run trains exactly what the uninterrupted one would)
    rollouts_ahead: list[ScheduledBatch] = field(default_factory=list)
