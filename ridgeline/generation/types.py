"""What crosses the generator boundary."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ridgeline.inference.types import SamplingParams, StopReason, TopLogprobs


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


Reward = float | list[float]
"""A trajectory's reward: one number (the outcome, credited to its last token), or one number per
response token (multi-turn: each turn's reward on the last token the model sampled in that turn)."""


def total_reward(reward: Reward) -> float:
    """The trajectory's return: the number itself, or the sum over its tokens."""
    return float(sum(reward)) if isinstance(reward, list) else float(reward)


def add_to_final(reward: Reward, amount: float) -> Reward:
    """`reward` with `amount` added where the outcome sits (the last non-zero token of a per-token
    reward, else its last token)."""
    if not isinstance(reward, list):
        return reward + amount
    if not reward:
        return reward
    out = list(reward)
    last = max((i for i, r in enumerate(out) if r != 0.0), default=len(out) - 1)
    out[last] += amount
    return out


@dataclass
class GeneratorOutput:
    """Per-trajectory results, in input order.

    response_ids holds everything after the prompt: the model's tokens of every turn and, in
    between, the environment's observation tokens; loss_masks is 1 on the former and 0 on the
    latter, and rollout_logprobs holds the engine's logprob of each model token (0.0 on observation
    tokens), so all three line up with response_ids position by position. rollout_top_logprobs
    does too when `sampling_params.logprobs` >= 1 (the engine's top-N per model token, [] on
    observation tokens); it is empty otherwise.

    trajectory_ids are the input's, row for row: consumers group samples by `uids` from here,
    never by re-pairing the output with the input it came from."""
    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[Reward]
    loss_masks: list[list[int]]
    stop_reasons: list[StopReason]
    rollout_logprobs: list[list[float]]
    responses: list[str]
    trajectory_ids: list[TrajectoryID]
    metrics: dict[str, float] = field(default_factory=dict)
    rollout_top_logprobs: list[list[TopLogprobs]] = field(default_factory=list)
    # the metadata of each trajectory's last environment step (e.g. {"parsed": "42"}), for eval dumps
    step_metadata: list[dict[str, Any]] = field(default_factory=list)
    # per trajectory, [start, end) of each turn's sampled ids in response_ids, in turn order (none
    # when the env never started): generation.step_wise cuts a trajectory into its turns' samples
    turn_spans: list[list[tuple[int, int]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def uids(self) -> list[str]:
        """The group (prompt) id of each row."""
        return [tid.uid for tid in self.trajectory_ids]

    def select(self, rows: list[int]) -> "GeneratorOutput":
        """These trajectories, in this order (a row may repeat); metrics are kept as they are."""
        picked = {f.name: [getattr(self, f.name)[i] for i in rows] if getattr(self, f.name) else []
                  for f in fields(self) if f.name != "metrics"}
        return GeneratorOutput(**picked, metrics=dict(self.metrics))

    @staticmethod
    def concat(outputs: list["GeneratorOutput"]) -> "GeneratorOutput":
        """One output holding all trajectories; metrics (counts and seconds) are summed."""
        joined = {f.name: [x for out in outputs for x in getattr(out, f.name)]
                  for f in fields(GeneratorOutput) if f.name != "metrics"}
        metrics: dict[str, float] = {}
        for out in outputs:
            for key, value in out.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        return GeneratorOutput(**joined, metrics=metrics)
