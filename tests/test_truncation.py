"""The truncation policy: each rule, their order and the eval rule, against numbers worked out by hand."""

from __future__ import annotations

import pytest

from ridgeline.generation.truncation import TruncationPolicy, apply_truncation_policy

# max_generate_length 8, buffer 4, factor 0.5: no penalty up to 4 tokens, then -0.125 per token, -0.5 at 8
DAPO = dict(overlong_buffer_len=4, overlong_buffer_penalty_factor=0.5, max_generate_length=8)

STOPS = ["stop", "length", "length", "length"]
LENGTHS = [5, 8, 8, 8]
PER_TOKEN = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0]   # a multi-turn reward, one number per token


def rewards():
    return [1.0, 1.0, 0.0, list(PER_TOKEN)]


def masks():
    return [[1] * 5, [1] * 8, [1] * 8, [1, 1, 1, 0, 0, 1, 1, 1]]


def shape(training=True, **settings):
    return apply_truncation_policy(STOPS, LENGTHS, rewards(), masks(), TruncationPolicy(**settings), training=training)


def test_everything_off_changes_nothing():
    out = shape()
    assert out.rewards == rewards() and out.loss_masks == masks()
    assert out.metrics == {"generate/zeroed_non_stop": 0.0}


def test_zero_reward_on_non_stop():
    out = shape(zero_reward_on_non_stop=True)
    assert out.rewards == [1.0, 0.0, 0.0, [0.0] * 8]
    assert out.loss_masks == masks()
    # rows 1 and 3 lost a reward; row 2 had none to lose
    assert out.metrics == {"generate/zeroed_non_stop": 2.0}


def test_soft_overlong_punishment_lands_on_the_outcome():
    out = shape(**DAPO)
    # 5 tokens: 0.5 * (4 - 5) / 4 = -0.125; 8 tokens: -0.5, on the last non-zero token of a per-token reward
    assert out.rewards == [0.875, 0.5, -0.5, [0.0] * 8]  # 0.5 - 0.5 on the per-token reward's outcome
    assert out.metrics == {"generate/zeroed_non_stop": 0.0, "reward/overlong_penalty_mean": -1.625 / 4}
    assert out.loss_masks == masks()


def test_overlong_filtering_masks_non_stop_rows_only():
    out = shape(apply_overlong_filtering=True)
    assert out.loss_masks == [[1] * 5, [0] * 8, [0] * 8, [0] * 8]
    assert out.rewards == rewards()  # the rows still count in their group's baseline


def test_all_rules_together_in_their_order():
    out = shape(zero_reward_on_non_stop=True, apply_overlong_filtering=True, **DAPO)
    # zeroed first, then penalised: a truncated row ends at -0.5 (penalising first and zeroing
    # after would have left 0.0); the all-zero per-token reward takes the penalty on its last token
    assert out.rewards == [0.875, -0.5, -0.5, [0.0] * 7 + [-0.5]]
    assert out.loss_masks == [[1] * 5, [0] * 8, [0] * 8, [0] * 8]
    assert out.metrics == {"generate/zeroed_non_stop": 2.0, "reward/overlong_penalty_mean": -1.625 / 4}


def test_eval_applies_only_the_zero_reward_rule():
    out = shape(training=False, zero_reward_on_non_stop=True, apply_overlong_filtering=True, **DAPO)
    assert out.rewards == [1.0, 0.0, 0.0, [0.0] * 8]
    assert out.loss_masks == masks()
    assert out.metrics == {"generate/zeroed_non_stop": 2.0}


def test_inputs_are_left_as_they_are():
    given_rewards, given_masks = rewards(), masks()
    apply_truncation_policy(STOPS, LENGTHS, given_rewards, given_masks,
                            TruncationPolicy(zero_reward_on_non_stop=True, apply_overlong_filtering=True, **DAPO),
                            training=True)
    assert given_rewards == rewards() and given_masks == masks()


def test_rows_must_line_up():
    with pytest.raises(ValueError, match="4 stop reasons, 3 lengths"):
        apply_truncation_policy(STOPS, LENGTHS[:3], rewards(), masks(), TruncationPolicy(), training=True)
