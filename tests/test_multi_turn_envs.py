"""Answer-feedback-retry envs (feedback.py): gsm8k_multi_turn_lenient and multiply_lenient;
prepare_multiply. (skyrl-gym's exact gsm8k_multi_turn and multiply: test_skyrl_envs.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from ridgeline.data import PromptDataset
from ridgeline.data.prepare_multiply import prepare_multiply
from ridgeline.envs import make
from ridgeline.envs.feedback import FeedbackEnv, Grade
from ridgeline.envs.multiply import MultiplyLenientEnv

GSM8K_FEEDBACK = "Your answer is incorrect. Please try again, and give the final answer after ####."


def extras(ground_truth: str) -> dict[str, Any]:
    return {"reward_spec": {"method": "rule", "ground_truth": ground_truth}}


# --- gsm8k_multi_turn_lenient -------------------------------------------------------------------


def test_gsm8k_multi_turn_wrong_then_right() -> None:
    env = make("gsm8k_multi_turn_lenient", extras=extras("72"))
    assert env.max_turns == 3
    out = env.step("She sold 70 clips. #### 70")
    assert out.observations == [{"role": "user", "content": GSM8K_FEEDBACK}]
    assert (out.reward, out.done) == (0.0, False)
    assert out.metadata == {"parsed": "70", "correct": False, "attempt": 1, "ground_truth": "72"}
    out = env.step("I forgot the 2 more. #### 72")
    assert (out.observations, out.reward, out.done) == ([], 1.0, True)
    assert out.metadata["correct"] is True
    assert env.get_metrics() == {"attempts": 2.0, "solved": 1.0}


def test_gsm8k_multi_turn_unparsable_and_last_turn() -> None:
    env = make("gsm8k_multi_turn_lenient", extras=extras("72"), format_score=0.1)
    out = env.step("I think it is 72")  # strict mode: no "####", nothing read
    assert (out.reward, out.done, out.metadata["parsed"]) == (0.0, False, None)
    assert out.observations[0]["content"] == GSM8K_FEEDBACK
    assert env.step("#### 71").done is False
    out = env.step("#### 73")  # third and last turn: ends with that answer's reward (format_score)
    assert (out.observations, out.reward, out.done) == ([], 0.1, True)
    assert env.get_metrics() == {"attempts": 3.0, "solved": 0.0}


def test_gsm8k_multi_turn_settings() -> None:
    env = make("gsm8k_multi_turn_lenient", env_config={"max_turns": 1, "mode": "flexible"}, extras=extras("72"))
    out = env.step("The answer is 71.")
    assert (out.reward, out.done) == (0.0, True)
    env = make("gsm8k_multi_turn_lenient", extras=extras("72"), mode="flexible", correct_score=2.0)
    assert env.step("so 72 in total").reward == 2.0
    with pytest.raises(TypeError, match="unknown settings"):
        make("gsm8k_multi_turn_lenient", extras=extras("72"), feedback="x")
    with pytest.raises(ValueError, match="mode"):
        make("gsm8k_multi_turn_lenient", extras=extras("72"), mode="lenient")


def test_gsm8k_multi_turn_right_first_time() -> None:
    env = make("gsm8k_multi_turn_lenient", extras=extras("72"))
    assert env.step("#### 72").reward == 1.0
    assert env.get_metrics() == {"attempts": 1.0, "solved": 1.0}


# --- multiply_lenient ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, reward",
    [
        ("123 * 456 = 56088, so \\boxed{56088}", 1.0),
        ("\\boxed{56,088}", 1.0),
        ("\\boxed{ 56088.0 }", 1.0),
        ("first \\boxed{1}, then \\boxed{56088}", 1.0),  # the last box is the answer
        ("\\boxed{56087}", 0.5),
        ("\\boxed{56088} no wait \\boxed{56089}", 0.5),
        ("\\boxed{123 \\times 456}", 0.5),  # restating the question is not an answer
        ("\\boxed{fifty-six thousand}", 0.5),
        ("56088", 0.0),
        ("\\boxed{}", 0.0),
        ("\\boxed{56088", 0.0),  # never closed
        ("", 0.0),
    ],
)
def test_multiply_rewards(response: str, reward: float) -> None:
    env = make("multiply_lenient", extras=extras("56088"))
    out = env.step(response)
    assert (out.reward, out.done, out.observations) == (reward, True, [])


def test_multiply_multi_turn_retry() -> None:
    env = make("multiply_lenient", extras=extras("56088"), max_turns=3)
    out = env.step("\\boxed{56000}")
    assert out.observations == [{"role": "user", "content": "Incorrect, try again"}]
    assert (out.reward, out.done, out.metadata["parsed"]) == (0.0, False, "56000")
    out = env.step("It is 56088")
    assert out.observations == [{"role": "user", "content": MultiplyLenientEnv.missing_box_message}]
    out = env.step("\\boxed{56088}")
    assert (out.reward, out.done) == (1.0, True)
    assert env.get_metrics() == {"attempts": 3.0, "solved": 1.0}

    env = make("multiply_lenient", extras=extras("56088"), max_turns=2)
    env.step("\\boxed{1}")
    out = env.step("\\boxed{2}")
    assert (out.reward, out.done) == (0.5, True)
    assert env.get_metrics() == {"attempts": 2.0, "solved": 0.0}


def test_multiply_needs_ground_truth_and_no_settings() -> None:
    with pytest.raises(ValueError, match="reward_spec"):
        make("multiply_lenient", extras={})
    with pytest.raises(TypeError, match="unknown settings"):
        make("multiply_lenient", extras=extras("1"), format_score=0.1)


# --- the base -----------------------------------------------------------------------------------


def test_feedback_env_subclass() -> None:
    class Yes(FeedbackEnv):
        default_max_turns = 2
        observation_role = "tool"

        def grade(self, action: str) -> Grade:
            return Grade(reward=1.0 if action == "yes" else -1.0, correct=action == "yes", parsed=action)

        def feedback(self, action: str, grade: Grade) -> str:
            return f"{action!r} is not yes"

    env = Yes()
    out = env.step("no")
    assert out.observations == [{"role": "tool", "content": "'no' is not yes"}]
    assert env.step(None).reward == -1.0  # type: ignore[arg-type]  # last turn; None read as ""


# --- prepare_multiply ---------------------------------------------------------------------------


def test_prepare_multiply(tmp_path) -> None:
    paths = prepare_multiply(tmp_path, num_train=40, num_val=10, num_digits=2, seed=3)
    assert set(paths) == {"train", "validation"}
    train, val = PromptDataset(paths["train"]), PromptDataset(paths["validation"])
    assert (len(train), len(val)) == (40, 10)
    problems = set()
    for row in list(train) + list(val):
        a, b = (int(x) for x in row.extra_info["expression"].split(" * "))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row.env_class == "multiply" and row.data_source == "multiply"
        assert row.prompt == [{"role": "user", "content": f"What is {a} * {b}? Put your final answer in \\boxed{{}}."}]
        assert row.reward_spec == {"method": "rule", "ground_truth": str(a * b)}
        assert make(row.env_class, extras=row.extras).step(f"\\boxed{{{a * b}}}").reward == 1.0
        problems.add((a, b))
    assert len(problems) == 50  # distinct, and validation does not overlap train
    # Same seed, same files; validation does not depend on num_train.
    again = prepare_multiply(tmp_path / "again", num_train=5, num_val=10, num_digits=2, seed=3)
    assert [r.prompt for r in PromptDataset(again["validation"])] == [r.prompt for r in val]
    lenient = prepare_multiply(tmp_path / "lenient", num_train=5, num_val=1, num_digits=2, env_class="multiply_lenient")
    row = PromptDataset(lenient["train"])[0]
    assert row.env_class == "multiply_lenient"
    assert make(row.env_class, extras=row.extras).step(f"\\boxed{{{row.reward_spec['ground_truth']}.0}}").reward == 1.0


def test_prepare_multiply_limits(tmp_path) -> None:
    # 1-digit operands are 1..9: 81 problems.
    paths = prepare_multiply(tmp_path, num_train=71, num_val=10, num_digits=1)
    assert len(PromptDataset(paths["train"])) == 71
    with pytest.raises(ValueError, match="only 81 distinct"):
        prepare_multiply(tmp_path, num_train=72, num_val=10, num_digits=1)
    with pytest.raises(ValueError, match="num_digits"):
        prepare_multiply(tmp_path, num_digits=0)
    big = prepare_multiply(tmp_path / "big", num_train=2, num_val=1, num_digits=30)
    row = PromptDataset(big["train"])[0]
    a, b = (int(x) for x in row.extra_info["expression"].split(" * "))
    assert len(str(a)) == 30 and row.reward_spec["ground_truth"] == str(a * b)
