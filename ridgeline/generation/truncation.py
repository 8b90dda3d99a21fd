"""What happens to truncated trajectories: one policy, one pure function.

A trajectory is truncated when its stop reason is not "stop": the engine ran out of
`max_generate_length` tokens in a turn, or the generator ended a multi-turn episode because the
next turn would not fit `generator.max_input_length` (it marks those "length" too). The generator
only records this; `apply_truncation_policy` decides what it costs, where a rollout is handed on:
`Trainer._generate_train` for training rollouts, `run_eval` for eval.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ridgeline.algorithms.reward_shaping import soft_overlong_punishment
from ridgeline.generation.types import Reward, add_to_final
from ridgeline.inference.types import StopReason


@dataclass(frozen=True)
class TruncationPolicy:
    """The settings of the three rules (SkyRL-Train's keys)."""

    zero_reward_on_non_stop: bool = False          # generator.zero_reward_on_non_stop
    apply_overlong_filtering: bool = False         # generator.apply_overlong_filtering
    overlong_buffer_len: int | None = None         # trainer.algorithm.overlong_buffer_len (None: off)
    overlong_buffer_penalty_factor: float = 1.0    # trainer.algorithm.overlong_buffer_penalty_factor
    max_generate_length: int = 0                   # generator.sampling_params.max_generate_length


@dataclass
class TruncationOutcome:
    rewards: list[Reward]
    loss_masks: list[list[int]]
    metrics: dict[str, float]


def apply_truncation_policy(stop_reasons: Sequence[StopReason], response_lengths: Sequence[int],
                            rewards: Sequence[Reward], loss_masks: Sequence[Sequence[int]],
                            policy: TruncationPolicy, *, training: bool) -> TruncationOutcome:
    """Shape rewards and loss masks of one rollout (all sequences row-aligned, B rows) by the
    rules below, in this order. The inputs are left as they are.

    1. `zero_reward_on_non_stop` (training and eval): a non-stop row's reward becomes 0 (every
       token of a per-token reward). It comes first because it decides what the row scored: an
       answer cut off mid-way is not an answer, even when the environment found one in it.
       Metric `generate/zeroed_non_stop`: rows whose non-zero reward was zeroed.
    2. DAPO's soft overlong punishment (training, `overlong_buffer_len` set): the length penalty
       of `soft_overlong_punishment(len, max_generate_length, ...)` is added where the outcome
       sits (`add_to_final`), stopped or not. After rule 1, so a truncated row ends at
       0 - penalty_factor instead of having its penalty zeroed away with its reward: running out
       of tokens is exactly what the penalty is for. Eval scores are left unpenalised.
       Metric `reward/overlong_penalty_mean`.
    3. `apply_overlong_filtering` (training): a non-stop row's loss mask becomes all 0, so its
       tokens get no gradient (DAPO: the reward of a cut-off sample is noise), while its reward
       still counts in its group's baseline. It touches only masks, so its place in the order
       changes no number.

    SkyRL-Train does 1 and 3 in its generator's postprocessing and 2 in the DAPO trainer's
    `postprocess_generator_output` after it: the same order. SkyRL-Train 0.3.1 filters rows
    whose last token is not eos; later versions (and this) test the stop reason, which also
    covers responses ended by a stop string.
    """
    size = len(stop_reasons)
    if not len(response_lengths) == len(rewards) == len(loss_masks) == size:
        raise ValueError(f"apply_truncation_policy: {size} stop reasons, {len(response_lengths)} lengths, "
                         f"{len(rewards)} rewards and {len(loss_masks)} loss masks; need one each per row")
    truncated = [reason != "stop" for reason in stop_reasons]
    shaped = list(rewards)
    metrics: dict[str, float] = {"generate/zeroed_non_stop": 0.0}
    if policy.zero_reward_on_non_stop:
        for row, cut in enumerate(truncated):
            if cut and _nonzero(shaped[row]):
                shaped[row] = _zeroed(shaped[row])
                metrics["generate/zeroed_non_stop"] += 1
    if training and policy.overlong_buffer_len is not None:
        penalties = soft_overlong_punishment(response_lengths, policy.max_generate_length, policy.overlong_buffer_len,
                                             policy.overlong_buffer_penalty_factor)
        shaped = [add_to_final(reward, penalty) for reward, penalty in zip(shaped, penalties)]
        metrics["reward/overlong_penalty_mean"] = sum(penalties) / max(1, size)
    masks = [list(mask) for mask in loss_masks]
    if training and policy.apply_overlong_filtering:
        masks = [[0] * len(mask) if cut else mask for mask, cut in zip(masks, truncated)]
    return TruncationOutcome(shaped, masks, metrics)


def _nonzero(reward: Reward) -> bool:
    return any(r != 0.0 for r in reward) if isinstance(reward, list) else reward != 0.0


def _zeroed(reward: Reward) -> Reward:
    return [0.0] * len(reward) if isinstance(reward, list) else 0.0
