"""The built-in gsm8k, gsm8k_multi_turn and text2sql envs against the real skyrl-gym 0.4.0 envs:
the same completions (the hand-written ones of test_skyrl_envs.py plus generated variations), each
env built the way its own generator builds it (SkyRL puts generator.max_turns in the extras,
Ridgeline passes it as a setting), must give the same reward, done flag and observations at every
turn. (SkyRL's multiply lives in SkyRL-Train's examples, not in skyrl-gym: test_skyrl_envs.py
holds its cases.)"""

from __future__ import annotations

import importlib.metadata
import itertools
import math
import random
from pathlib import Path
from typing import Any

import pytest
from test_skyrl_envs import GOLD, GSM8K_CASES, THINK, build_zoo, solution

from ridgeline.envs import make
from ridgeline.envs.skyrl_rules import first_hash_answer

skyrl_gym = pytest.importorskip(
    "skyrl_gym", reason="skyrl-gym is not installed: pip install -e '.[skyrl-gym]' (make setup installs it)")
OmegaConf = pytest.importorskip("omegaconf").OmegaConf


def test_the_reference_is_skyrl_gym_0_4_0():
    assert importlib.metadata.version("skyrl-gym") == "0.4.0"


# --- completions ---------------------------------------------------------------------------------

_NUMBERS = ["72", "72.0", "72.", "7,2", "1,234", "1234", "-72", "- 72", "0", "0.5", ".5", ",", "", "$72",
            "\u0667\u0662"]
_FORMS = ["#### {n}", "####{n}", "####  {n}", "##### {n}", "#### {n} dollars", "The answer is {n}.",
          "\\boxed{{{n}}}", "#### {n}\n#### 73", "#### 1\n#### {n}", "#### ${n}", "**#### {n}**"]
_PREFIXES = ["", "Natalia sold 48/2 = 24 clips in May.\n"]
GSM8K_COMPLETIONS = sorted({case[0] for case in GSM8K_CASES}
                           | {p + f.format(n=n) for p, f, n in itertools.product(_PREFIXES, _FORMS, _NUMBERS)})
GSM8K_TRUTHS = ["72", "1234", "-72", "0.5", "1,234", "0"]


def test_enough_generated_completions():
    assert len(GSM8K_COMPLETIONS) >= 300


def skyrl_step(env: Any, action: str) -> Outcome:
    out = env.step(action)
    return out["reward"], out["done"], out["observations"]


def ridgeline_step(env: Any, action: str) -> Outcome:
    out = env.step(action)
    return out.reward, out.done, out.observations


Outcome = tuple[float, bool, list[dict[str, str]]]


def play(skyrl_env: Any, ridgeline_env: Any, actions: list[str]) -> list[Outcome]:
    """Step both envs with ``actions`` until the episode is done; assert that every step agrees;
    return skyrl-gym's (reward, done, observations) per step."""
    outcomes = []
    for action in actions:
        expected, got = skyrl_step(skyrl_env, action), ridgeline_step(ridgeline_env, action)
        assert got == expected, (len(outcomes) + 1, actions)
        outcomes.append(expected)
        if expected[1]:
            break
    return outcomes


# --- gsm8k ---------------------------------------------------------------------------------------


def test_gsm8k_answer_reading_matches():
    from skyrl_gym.envs.gsm8k.utils import extract_solution

    for completion in GSM8K_COMPLETIONS:
        assert first_hash_answer(completion) == extract_solution(completion, method="strict"), completion


@pytest.mark.parametrize("truth", GSM8K_TRUTHS)
def test_gsm8k_matches(truth):
    row = {"reward_spec": {"method": "rule", "ground_truth": truth}}
    rewards = set()
    for completion in GSM8K_COMPLETIONS:
        expected = skyrl_gym.make("gsm8k", env_config=OmegaConf.create({}), extras={**row, "max_turns": 1})
        got = make("gsm8k", env_config={"max_turns": 1}, extras=row)
        [(reward, done, _)] = play(expected, got, [completion])
        rewards.add(reward)
    # both outcomes occur; a ground truth with a comma never matches (answers lose their commas)
    assert rewards == ({0.0} if "," in truth else {0.0, 1.0})


@pytest.mark.parametrize("max_turns", [1, 2, 3, 5])
def test_gsm8k_multi_turn_matches(max_turns):
    rng = random.Random(max_turns)
    row = {"reward_spec": {"method": "rule", "ground_truth": "72"}, "extra_info": {"split": "train"}}
    lengths, rewards = set(), set()
    for _ in range(60):
        actions = rng.choices(GSM8K_COMPLETIONS, k=max_turns)
        expected = skyrl_gym.make("gsm8k_multi_turn", env_config=OmegaConf.create({}),
                                  extras={**row, "max_turns": max_turns})
        got = make("gsm8k_multi_turn", env_config={"max_turns": max_turns}, extras=row)
        outcomes = play(expected, got, actions)
        assert outcomes[-1][1]  # every episode ran to its end
        assert got.get_metrics() == expected.get_metrics()
        lengths.add(len(outcomes))
        rewards |= {reward for reward, _, _ in outcomes}
    assert max(lengths) == max_turns and rewards == {0.0, 0.2 / max_turns, 1.0}


# --- text2sql ------------------------------------------------------------------------------------

EXPLORE = [
    f"{THINK}<sql>SELECT name FROM animals</sql>",
    f"{THINK}<sql>SELECT legs, count(*) FROM animals GROUP BY legs</sql>",
    f"{THINK}<sql>SELECT * FROM animals WHERE legs > 10</sql>",
    f"{THINK}<sql>SELECT name, legs * 1.5, NULL FROM animals</sql>",
    f"{THINK}<sql>SELEC name</sql>",
    f"{THINK}<sql>SELECT 1; SELECT 2</sql>",
    f"{THINK}<sql>DELETE FROM animals</sql>",
    f"{THINK}<sql>SELECT * FROM no_table</sql>",
    # tables of 8999 and 9004 characters: skyrl-gym cuts those over 9000 to 50 rows
    *(f"{THINK}<sql>WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {last}) "
      "SELECT i FROM n</sql>" for last in (1799, 1800)),
    f"{THINK}<sql>\nSELECT name\nFROM animals\n</sql> and <sql>SELECT 2</sql>",
    "<sql>SELECT name FROM animals WHERE legs = 4</sql>",
    f"{THINK}Let me think more.",
    "I am not sure.",
    "<think>quoting <observation> here</think><sql>SELECT 1</sql>",
    "<THINK>upper case</THINK><sql>SELECT 1</sql>",  # opens with <think> after an observation, any case
]
ANSWERS = [
    solution(GOLD),
    solution("SELECT name FROM animals WHERE legs >= 4"),
    solution("SELECT name FROM animals"),
    solution("SELECT legs FROM animals WHERE legs = 4"),
    solution("SELEC x"),
    solution("UPDATE animals SET legs = 4"),
    solution(GOLD, think=""),
    f"{THINK}<solution>SELECT 1</solution><solution>{GOLD}</solution>",
    f"{THINK}<solution><sql>{GOLD}</sql></solution>",
    f"{THINK}<solution>{GOLD}</solution> </solution>",
    f"</solution>{THINK}<solution>{GOLD}",
    f"Answer: {THINK}<solution>{GOLD}</solution>",
    f"{THINK}<SOLUTION>{GOLD}</SOLUTION>",
    f"<Think>case</Think>{solution(GOLD)}",
    f"{THINK}<solution>{GOLD} <observation></solution>",
    f"{THINK}<solution><solution>{GOLD}</solution>",
]
GOLDS = [GOLD, "SELECT name FROM animals WHERE legs = 3", "SELECT name FROM animals ORDER BY name"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sql_data")
    build_zoo(root)
    return root


def sql_envs(zoo: Path, gold: str, max_turns: int) -> tuple[Any, Any]:
    row = {"db_id": "zoo", "data": "spider", "reward_spec": {"method": "rule", "ground_truth": gold}}
    expected = skyrl_gym.make("text2sql", env_config=OmegaConf.create({"db_path": str(zoo)}),
                              extras={**row, "max_turns": max_turns})
    got = make("text2sql", env_config={"db_path": str(zoo), "max_turns": max_turns}, extras=row)
    return expected, got


@pytest.mark.parametrize("gold", GOLDS)
def test_text2sql_single_answers_match(zoo, gold):
    rewards = set()
    for answer in ANSWERS + EXPLORE:
        [(reward, done, _)] = play(*sql_envs(zoo, gold, max_turns=1), [answer])
        rewards.add(reward)
    assert rewards == {-1.0, 0.0, 1.0}


@pytest.mark.parametrize("max_turns", [2, 3, 5])
def test_text2sql_episodes_match(zoo, max_turns):
    rng = random.Random(max_turns)
    rewards, lengths = set(), set()
    assert math.gcd(len(ANSWERS), len(GOLDS)) == 1  # so the episodes below meet every (gold, answer) pair
    for episode in range(len(GOLDS) * len(ANSWERS)):
        gold, answer = GOLDS[episode % len(GOLDS)], ANSWERS[episode % len(ANSWERS)]
        explore = rng.choices(EXPLORE, k=rng.randint(0, max_turns - 1))
        # an answer skyrl-gym does not take as one ("<SOLUTION>") lets the episode go on
        actions = (explore + [answer] + rng.choices(EXPLORE, k=max_turns))[:max_turns]
        outcomes = play(*sql_envs(zoo, gold, max_turns), actions)
        assert outcomes[-1][1]  # every episode ran to its end
        rewards.add(outcomes[-1][0])
        lengths.add(len(outcomes))
    assert rewards == {-1.0, 0.0, 1.0} and max(lengths) == max_turns
