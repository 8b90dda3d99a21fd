"""The samples a rollout trains on: one per trajectory, or with SkyRL's
`generator.step_wise_trajectories` one per turn ("step").

Turn k of a trajectory (`GeneratorOutput.turn_spans[i][k] = (s, e)`) becomes the sample

    prompt   = prompt_token_ids[i] + response_ids[i][:s]   exactly the ids the engine was given for turn k
    response = response_ids[i][s:e]                       exactly the ids it sampled (loss mask and
                                                          rollout logprobs cut alike)

so every step is a prefix of the trajectory's own training sequence (token-in / token-out: nothing
is decoded and re-encoded). The ids between turns (the end-of-turn token the generator closed a
message with, the observation) are in the next step's prompt; an eos appended after the last turn
is in no step (loss mask 0 there: no gradient is lost).

Rewards: each step carries the rewards that sit on its own tokens (a turn's reward is on its last
sampled token), so the steps of a trajectory sum to the trajectory's return. Reward on a token in
no step (a truncation penalty `add_to_final` put on an appended eos) goes to the last sampled
token before it. A number (single-turn, or a failed episode's 0.0) goes to the last step.

Truncation rules, dynamic sampling and the reward metrics act on trajectories before the cut
(`Trainer.collect_rollout`); the trainer computes advantages over each trajectory's stitched steps
(`training.trajectory_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ridgeline.generation.types import GeneratorOutput, Reward


@dataclass
class TrainingSamples:
    """Row-aligned samples for `build_training_batch`; `trajectory_index[j]` is the output row sample
    j was cut from (ascending; every trajectory has at least one sample, its turns in order)."""

    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    loss_masks: list[list[int]]
    rewards: list[Reward]
    rollout_logprobs: list[list[float]]
    uids: list[str]
    trajectory_index: list[int]

    def __len__(self) -> int:
        return len(self.response_ids)


def training_samples(out: GeneratorOutput, step_wise: bool) -> TrainingSamples:
    """One sample per trajectory, or (`step_wise`) one per turn of each trajectory."""
    samples = TrainingSamples([], [], [], [], [], [], [])
    for i in range(len(out)):
        spans = out.turn_spans[i] if step_wise else []
        if not spans:  # the whole trajectory (single-sample mode, or an env that never started)
            _append(samples, i, out, out.prompt_token_ids[i], out.response_ids[i], out.loss_masks[i],
                    out.rewards[i], out.rollout_logprobs[i])
            continue
        response = out.response_ids[i]
        for reward, (start, end) in zip(step_rewards(out.rewards[i], spans), spans):
            _append(samples, i, out, out.prompt_token_ids[i] + response[:start], response[start:end],
                    out.loss_masks[i][start:end], reward, out.rollout_logprobs[i][start:end])
    return samples


def _append(samples: TrainingSamples, row: int, out: GeneratorOutput, prompt: list[int], response: list[int],
            loss_mask: list[int], reward: Reward, logprobs: list[float]) -> None:
    samples.prompt_token_ids.append(list(prompt))
    samples.response_ids.append(list(response))
    samples.loss_masks.append(list(loss_mask))
    samples.rewards.append(reward)
    samples.rollout_logprobs.append(list(logprobs))
    samples.uids.append(out.trajectory_ids[row].uid)
    samples.trajectory_index.append(row)


def step_rewards(reward: Reward, spans: list[tuple[int, int]]) -> list[Reward]:
    """A trajectory's reward cut along its turns' spans: a per-token list gives each step the
    slice over its own tokens, with reward on a token outside every span moved to the last
    sampled token before it; a number goes to the last step (0.0 on the others)."""
    if not isinstance(reward, list):
        return [*([0.0] * (len(spans) - 1)), reward]
    steps: list[list[float]] = [list(reward[start:end]) for start, end in spans]
    inside = {p for start, end in spans for p in range(start, end)}
    for position, value in enumerate(reward):
        if value == 0.0 or position in inside:
            continue
        before = [k for k, (start, end) in enumerate(spans) if start < end <= position]
        if not before:
            raise ValueError(f"a reward of {value} sits at response token {position}, before any token the "
                             "model sampled: no step can carry it")
        steps[before[-1]][-1] += value
    return [*steps]  # as list[Reward] (list is invariant)


__all__ = ["TrainingSamples", "training_samples", "step_rewards"]
