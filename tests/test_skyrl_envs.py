"""The envs named like skyrl-gym's (gsm8k, gsm8k_multi_turn, text2sql) and SkyRL-Train's multiply
example score as those do: hand-written completions with the reward each must get, read off
skyrl-gym 0.4.0's rules (first "#### ", string comparison, format scores, -1 for a malformed SQL
episode...). No skyrl-gym needed; test_skyrl_gym_parity.py checks the same cases against it."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from ridgeline.envs import make
from ridgeline.envs import text2sql as skyrl_sql
from ridgeline.envs.skyrl_rules import first_boxed, first_hash_answer

# --- gsm8k ---------------------------------------------------------------------------------------

# (completion, ground truth, what skyrl-gym reads, single-turn reward)
GSM8K_CASES: list[tuple[str, str, str | None, float]] = [
    ("#### 72", "72", "72", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "72", "72", 1.0),
    ("####72", "72", None, 0.0),                       # no space after ####
    ("####  72", "72", None, 0.0),                     # two spaces
    ("#### 72.0", "72", "72.0", 0.0),                  # compared as text
    ("#### 72.", "72", "72.", 0.0),
    ("#### 1,234", "1234", "1234", 1.0),               # commas removed from the answer...
    ("#### 1234", "1,234", "1234", 0.0),               # ...but not from the ground truth
    ("#### 7,2", "72", "72", 1.0),                     # anywhere in the run
    ("#### 72,000", "72000", "72000", 1.0),
    ("#### $72", "72", None, 0.0),                     # a dollar sign is not part of the number
    ("#### $5 and later #### 72", "72", "72", 1.0),     # the first "#### <number>", not the first ####
    ("#### 5 first, then #### 72", "72", "5", 0.0),    # the first one wins
    ("#### 72\n#### 73", "72", "72", 1.0),
    ("##### 72", "72", "72", 1.0),
    ("#### 72 apples", "72", "72", 1.0),
    ("#### 72-3", "72", "72", 1.0),                    # a minus only at the start
    ("#### -72", "-72", "-72", 1.0),
    ("#### -72", "72", "-72", 0.0),
    ("#### - 72", "-72", None, 0.0),
    ("#### --72", "-72", None, 0.0),
    ("#### -0", "0", "-0", 0.0),
    ("#### 0.5", "0.5", "0.5", 1.0),
    ("#### .5", "0.5", ".5", 0.0),
    ("#### 1.2.3", "72", "1.2.3", 0.0),
    ("#### ,", "72", "", 0.0),                         # read: the empty string
    ("#### ...", "72", "...", 0.0),
    ("#### 72", " 72", "72", 0.0),                     # no stripping of the ground truth
    ("The answer is 72.", "72", None, 0.0),
    ("\\boxed{72}", "72", None, 0.0),                  # boxes are not read
    ("#### \uff17\uff12", "72", None, 0.0),            # full-width digits are not digits
    ("", "72", None, 0.0),
]


def gsm8k_extras(truth: Any, **more: Any) -> dict[str, Any]:
    return {"reward_spec": {"method": "rule", "ground_truth": truth}, **more}


@pytest.mark.parametrize("completion, truth, read, reward", GSM8K_CASES)
def test_gsm8k_reads_and_scores_like_skyrl_gym(completion, truth, read, reward):
    assert first_hash_answer(completion) == read
    out = make("gsm8k", extras=gsm8k_extras(truth)).step(completion)
    assert (out.reward, out.done, out.observations) == (reward, True, [])
    assert out.metadata == {"parsed": read, "ground_truth": truth}


def test_gsm8k_needs_a_text_ground_truth_and_takes_no_settings():
    with pytest.raises(ValueError, match="reward_spec"):
        make("gsm8k", extras={"data_source": "x"})
    with pytest.raises(ValueError, match="must be a string .* write it as '72'"):
        make("gsm8k", extras=gsm8k_extras(72))  # skyrl-gym would score every answer 0
    with pytest.raises(TypeError, match="unknown settings"):
        make("gsm8k", extras=gsm8k_extras("72"), format_score=0.1)


# --- gsm8k_multi_turn ----------------------------------------------------------------------------

RETRY = ("Please provide your step-by-step reasoning, and also include a tentative numeric answer at the end "
         "in the exact format: '#### ANSWER'.")
FINAL = "Now provide only the final numeric answer in the exact format: '#### ANSWER'."


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_gsm8k_multi_turn_scores_every_turn():
    env = make("gsm8k_multi_turn", extras=gsm8k_extras("72"))
    assert env.max_turns == 5  # nothing says otherwise
    steps = [env.step(text) for text in ("#### 70", "no answer yet", "#### 72.0", "so #### 72")]
    # a readable wrong answer earns 0.2 / max_turns, none earns 0, the right one 1.0 and ends it
    assert [s.reward for s in steps] == [0.2 / 5, 0.0, 0.2 / 5, 1.0]
    assert [s.done for s in steps] == [False, False, False, True]
    assert [s.observations for s in steps] == [user(RETRY), user(RETRY), user(RETRY), []]
    assert env.get_metrics() == {"steps": 4.0}


def test_gsm8k_multi_turn_last_turns():
    env = make("gsm8k_multi_turn", extras=gsm8k_extras("72"), max_turns=3)
    first, second, third = (env.step(text) for text in ("#### 1", "#### 2", "#### 3"))
    assert (first.observations, second.observations, third.observations) == (user(RETRY), user(FINAL), [])
    assert [s.reward for s in (first, second, third)] == [0.2 / 3] * 3
    assert (second.done, third.done) == (False, True)
    one = make("gsm8k_multi_turn", extras=gsm8k_extras("72"), max_turns=1).step("####72")  # unreadable
    assert (one.reward, one.done, one.observations) == (0.0, True, [])
    assert make("gsm8k_multi_turn", extras=gsm8k_extras("72"), max_turns=1).step("#### 7").reward == 0.2


def test_gsm8k_multi_turn_max_turns_sources():
    # the setting (what the generator passes: generator.max_turns), then extras, then extra_info
    assert make("gsm8k_multi_turn", extras=gsm8k_extras("72", max_turns=2), max_turns=4).max_turns == 4
    assert make("gsm8k_multi_turn", extras=gsm8k_extras("72", max_turns=2)).max_turns == 2
    assert make("gsm8k_multi_turn", extras=gsm8k_extras("72", extra_info={"max_turns": 3})).max_turns == 3
    with pytest.raises(ValueError, match="must be a string"):
        make("gsm8k_multi_turn", extras=gsm8k_extras(72.0))


# --- multiply (SkyRL-Train's examples/multiply/env.py) -------------------------------------------

# (completion, ground truth, what the env reads, reward when the episode ends there)
MULTIPLY_CASES: list[tuple[str, Any, str | None, float]] = [
    ("123 * 456 = 56088, so \\boxed{56088}", "56088", "56088", 1.0),
    ("\\boxed{ 56088 }", "56088", " 56088 ", 1.0),             # both sides stripped
    ("\\boxed{\n56088\n}", "56088", "\n56088\n", 1.0),
    ("$\\boxed{56088}$", "56088", "56088", 1.0),
    ("\\boxed{56088}", 56088, "56088", 1.0),                    # str() of the ground truth
    ("\\boxed{56088}", " 56088 ", "56088", 1.0),
    ("\\boxed{56,088}", "56088", "56,088", 0.5),                # compared as text
    ("\\boxed{56088.0}", "56088", "56088.0", 0.5),
    ("first \\boxed{1}, then \\boxed{56088}", "56088", "1", 0.5),  # the first box
    ("\\boxed{56088} no wait \\boxed{56089}", "56088", "56088", 1.0),
    ("\\boxed{} then \\boxed{56088}", "56088", "56088", 1.0),   # an empty box is skipped
    ("\\boxed{ }", "56088", " ", 0.5),                          # a blank one is not
    ("\\boxed{\\frac{56088}{1}}", "56088", "\\frac{56088", 0.5),  # no brace matching
    ("\\boxed{123 \\times 456}", "56088", "123 \\times 456", 0.5),
    ("\\boxed{56088", "56088", None, 0.0),                      # never closed
    ("\\boxed {56088}", "56088", None, 0.0),
    ("\\fbox{56088}", "56088", None, 0.0),
    ("56088", "56088", None, 0.0),
    ("", "56088", None, 0.0),
]


@pytest.mark.parametrize("completion, truth, read, reward", MULTIPLY_CASES)
def test_multiply_reads_and_scores_like_skyrl_example(completion, truth, read, reward):
    assert first_boxed(completion) == read
    out = make("multiply", extras=gsm8k_extras(truth), max_turns=1).step(completion)
    assert (out.reward, out.done, out.observations) == (reward, True, [])


def test_multiply_retries_with_skyrl_feedback():
    env = make("multiply", extras=gsm8k_extras("56088"))
    assert env.max_turns == 5  # the example's default without extras["max_turns"]
    assert make("multiply", extras=gsm8k_extras("1", max_turns=2)).max_turns == 2
    env = make("multiply", extras=gsm8k_extras("56088"), max_turns=3)
    out = env.step("\\boxed{ 56000 }")
    assert (out.reward, out.done) == (0.0, False)  # a wrong answer before the last turn earns nothing
    assert out.observations == user("Your answer ' 56000 ' is incorrect. Please try again.")
    out = env.step("It is 56088")
    assert out.observations == user("Please provide your answer in the format \\boxed{your_answer}.")
    out = env.step("\\boxed{56088}")
    assert (out.reward, out.done, out.observations) == (1.0, True, [])
    env = make("multiply", extras=gsm8k_extras("56088"), max_turns=2)
    assert env.step("\\boxed{1}").reward == 0.0
    assert (env.step("\\boxed{2}").reward, env.turns) == (0.5, 2)  # the last turn keeps its 0.5


def test_multiply_needs_ground_truth():
    with pytest.raises(ValueError, match="reward_spec"):
        make("multiply", extras={})
    with pytest.raises(ValueError, match="reward_spec"):
        make("multiply", extras=gsm8k_extras(None))
    with pytest.raises(TypeError, match="unknown settings"):
        make("multiply", extras=gsm8k_extras("1"), format_score=0.1)


# --- text2sql ------------------------------------------------------------------------------------

GOLD = "SELECT name FROM animals WHERE legs = 4"
THINK = "<think>Four-legged ones.</think>\n"


def build_zoo(db_path: Path) -> Path:
    """``<db_path>/spider/database/zoo/zoo.sqlite``: skyrl-gym's Spider layout."""
    db_file = db_path / "spider" / "database" / "zoo" / "zoo.sqlite"
    db_file.parent.mkdir(parents=True)
    with sqlite3.connect(db_file) as conn:
        conn.execute("CREATE TABLE animals (name TEXT, legs INTEGER)")
        conn.executemany("INSERT INTO animals VALUES (?, ?)", [("cat", 4), ("bird", 2), ("snake", 0), ("dog", 4)])
    conn.close()
    return db_file


@pytest.fixture()
def zoo(tmp_path: Path) -> Path:
    build_zoo(tmp_path)
    return tmp_path


def sql_row(gold: str = GOLD, **more: Any) -> dict[str, Any]:
    return {"db_id": "zoo", "data": "spider", "reward_spec": {"method": "rule", "ground_truth": gold}, **more}


def sql_env(zoo: Path, gold: str = GOLD, max_turns: int = 5):
    return make("text2sql", env_config={"db_path": str(zoo), "max_turns": max_turns}, extras=sql_row(gold))


def observation(body: str, turns_left: int) -> str:
    reminder = f"<reminder>You have {turns_left} turns left to complete the task.</reminder>"
    return f"\n\n<observation>{body}\n{reminder}</observation>\n\n"


def solution(sql: str, think: str = THINK) -> str:
    return f"{think}<solution>{sql}</solution>"


@pytest.mark.parametrize("answer, reward", [
    (solution(GOLD), 1.0),
    (solution("SELECT name FROM animals WHERE legs > 3 UNION ALL SELECT 'cat'"), 1.0),  # rows as a set
    (solution("select name from animals where legs = 4 order by name desc"), 1.0),
    (solution("SELECT name FROM animals"), 0.0),
    (solution("SELECT name, legs FROM animals WHERE legs = 4"), 0.0),
    (solution("SELEC name"), 0.0),                                          # an error
    (solution(GOLD, think=""), -1.0),                                       # no <think>
    (solution(GOLD, think="<think></think>"), 1.0),                         # an empty one is enough
    (solution(GOLD, think="<THINK>x</THINK>"), -1.0),                       # <think> is case-sensitive
    (f"{THINK}<solution>SELECT 1</solution><solution>{GOLD}</solution>", -1.0),  # two solutions
    (f"{THINK}<solution><sql>{GOLD}</sql></solution>", -1.0),               # a tag inside
    (f"{THINK}<solution>{GOLD} <Observation></solution>", -1.0),
    (f"{THINK}<solution><solution>{GOLD}</solution>", -1.0),
    (f"{THINK}<solution>{GOLD}</solution> </solution>", -1.0),
    (f"</solution>{THINK}<solution>{GOLD}", -1.0),                          # ends it, but not closed after
    (f"{THINK}<solution>  {GOLD}\n</solution> done", 1.0),                  # stripped
])
def test_text2sql_solution_rewards(zoo, answer, reward):
    out = sql_env(zoo).step(answer)
    assert (out.reward, out.done, out.observations) == (reward, True, [])


def test_text2sql_exploration_and_episode_format(zoo):
    env = sql_env(zoo)
    out = env.step(f"{THINK}<sql>SELECT legs FROM animals WHERE name = 'cat'</sql>")
    assert (out.reward, out.done) == (0.0, False)
    assert out.observations == user(observation(" 0\n 4", turns_left=4))  # pandas' table, column "0"
    out = env.step(f"{THINK}Hmm.")  # no query: the tool asks for the format
    assert out.observations == user(observation(
        "Your previous action is invalid. Follow the format of outputting thinking process and sql tool, "
        "and try again.", turns_left=3))
    out = env.step(f"{THINK}<sql>SELEC legs</sql> and <sql>SELECT 1</sql>")  # the first block runs
    db_file = str(zoo / "spider" / "database" / "zoo" / "zoo.sqlite")
    assert out.observations == user(observation(
        f'Error executing SQL: near "SELEC": syntax error, db file: {db_file}', turns_left=2))
    # after every observation the next response must open with <think>
    assert env.step(solution(GOLD)).reward == 1.0
    env = sql_env(zoo)
    env.step(f"{THINK}<sql>SELECT 1</sql>")
    assert env.step("Answer: " + solution(GOLD)).reward == -1.0


def test_text2sql_last_turn_without_solution_is_malformed(zoo):
    env = sql_env(zoo, max_turns=2)
    assert env.step(f"{THINK}<sql>SELECT 1</sql>").done is False
    out = env.step(f"{THINK}<sql>{GOLD}</sql>")  # the last turn ends it; no <solution> in the episode
    assert (out.reward, out.done, out.observations) == (-1.0, True, [])


def test_text2sql_writes_run_and_roll_back(zoo):
    db_file = zoo / "spider" / "database" / "zoo" / "zoo.sqlite"
    before = hashlib.sha256(db_file.read_bytes()).hexdigest()
    env = sql_env(zoo)
    out = env.step(f"{THINK}<sql>DELETE FROM animals</sql>")
    assert out.observations == user(observation("Empty DataFrame\nColumns: []\nIndex: []", turns_left=4))
    assert hashlib.sha256(db_file.read_bytes()).hexdigest() == before
    assert env.step(solution(GOLD)).reward == 1.0  # the rows are all still there
    # skyrl-gym compares a write's empty result with the gold rows: an empty gold result matches
    empty_gold = "SELECT name FROM animals WHERE legs = 3"
    assert sql_env(zoo, gold=empty_gold).step(solution("UPDATE animals SET legs = 1")).reward == 1.0
    assert hashlib.sha256(db_file.read_bytes()).hexdigest() == before


def test_text2sql_long_tables_are_cut_and_slow_queries_time_out(zoo, monkeypatch):
    many = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3000) SELECT i, 'row' FROM n"
    text = sql_env(zoo).step(f"<sql>{many}</sql>").observations[0]["content"]
    body = text.split("<observation>", 1)[1].split("\n<reminder>", 1)[0]
    assert body.startswith("Truncated to 50 lines since returned response too long: ")
    assert len(body.splitlines()) == 51  # the header and 50 rows
    monkeypatch.setattr(skyrl_sql, "EXPLORE_TIMEOUT_S", 0.2)
    endless = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"
    out = sql_env(zoo).step(f"<sql>{endless}</sql>")
    assert out.observations == user(observation(f"SQL Timeout:\n{endless}", turns_left=4))


def test_text2sql_rows_and_config(zoo, tmp_path):
    env = make("text2sql", env_config={"db_path": str(zoo)}, extras=sql_row())
    assert env.max_turns == 5
    assert make("text2sql", env_config={"db_path": str(zoo)}, extras=sql_row(max_turns=3)).max_turns == 3
    with pytest.raises(ValueError, match=r"\['data'\].*text2sql_lenient"):
        make("text2sql", env_config={"db_path": str(zoo)},
             extras={"db_id": "zoo", "reward_spec": {"ground_truth": GOLD}})
    with pytest.raises(ValueError, match="one of synsql, spider, bird"):
        make("text2sql", env_config={"db_path": str(zoo)}, extras=sql_row(data="wikisql"))
    with pytest.raises(FileNotFoundError, match="bird/train/train_databases/zoo/zoo.sqlite"):
        make("text2sql", env_config={"db_path": str(zoo)}, extras=sql_row(data="bird"))
    with pytest.raises(FileNotFoundError, match="/home/ray/default/sql_data"):  # SkyRL's default db_path
        make("text2sql", extras=sql_row())
    with pytest.raises(ValueError, match=r"needs extras\['reward_spec'\]\['ground_truth'\]"):
        make("text2sql", env_config={"db_path": str(zoo)}, extras=sql_row(gold=None))
    with pytest.raises(ValueError, match="must be a string"):
        make("text2sql", env_config={"db_path": str(zoo)}, extras=sql_row(gold=["SELECT 1"]))
    with pytest.raises(TypeError, match="unknown settings"):
        make("text2sql", env_config={"db_root": str(zoo)}, extras=sql_row())
