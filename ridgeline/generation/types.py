"""What crosses the generator boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ridgeline.inference.types import SamplingParams, StopReason


@dataclass(frozen=True)
class TrajectoryID:
    uid: str          # the prompt's id: trajectories with the same uid form a group
    repetition: int   # which of the n samples of that prompt


@dataclass
class GeneratorInput:
    prompts: list[list[dict[str, str]]]   # chat messages, one entry per trajectory
    env_classes: list[str]
    env_extras: list[dict[str, Any]]
    trajectory_ids: list[TrajectoryID]
    sampling_params: SamplingParams
    global_step: int = 0
    mode: str = "train"                   # train | eval


@dataclass
class GeneratorOutput:
    """Per-trajectory results, in input order."""
    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float]
    loss_masks: list[list[int]]
    stop_reasons: list[StopReason]
    rollout_logprobs: list[list[float]]
    responses: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
