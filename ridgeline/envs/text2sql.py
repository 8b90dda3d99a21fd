"""``text2sql``: skyrl-gym 0.4.0's multi-turn SQL env (SkyRL-SQL), exactly.

Rows and config as SkyRL writes them: ``db_id`` and ``data`` (``synsql``, ``spider`` or
``bird``) are row columns, ``reward_spec.ground_truth`` is the gold SQL, and the database is
``<db_path>/<folder of data>/<db_id>/<db_id>.sqlite`` with ``db_path`` from
``environment.skyrl_gym.text2sql.db_path`` (SkyRL's default ``/home/ray/default/sql_data``).

Each turn (up to ``max_turns``: the setting, which the generator sets to ``generator.max_turns``,
else ``extras["max_turns"]``, else 5):

* a response holding both ``<solution>`` and ``</solution>``, or the last turn, ends the episode.
  Its reward is computed on every message of the episode joined (responses and observations):
  -1.0 unless the text has exactly one ``<solution>...</solution>``, no think/sql/observation tag
  inside it, at least one ``<think>...</think>``, and ``<think>`` first after every
  ``</observation>`` before it; else 1.0 when the solution's rows equal the gold query's rows as
  sets (order and duplicates ignored), 0.0 otherwise (errors and 30 s timeouts included);
* otherwise reward 0: the first ``<sql>...</sql>`` is run (5 s limit) and the rows come back as a
  pandas table inside ``<observation>`` with a reminder of the turns left (or the error, or a note
  that the response had no query).

Queries run as skyrl-gym runs them: inside a transaction that is always rolled back, so the
database file is unchanged after any statement, but writes do run (and a write's empty result
can match an empty gold result). ``text2sql_lenient`` runs them on a read-only, guarded
connection instead (:mod:`ridgeline.envs.sql_executor`).
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import threading
from dataclasses import dataclass
from typing import Any

from .base import Env, StepOutput
from .registry import register
from .skyrl_rules import skyrl_ground_truth, skyrl_max_turns

__all__ = [
    "DATASET_FOLDERS",
    "DEFAULT_DB_PATH",
    "Text2SQLEnv",
    "TransactionResult",
    "run_rolled_back",
    "sql_observation",
    "verified_solution",
]

logger = logging.getLogger(__name__)

DEFAULT_DB_PATH = "/home/ray/default/sql_data"
# the row's "data" -> where its databases sit under db_path
DATASET_FOLDERS = {
    "synsql": "SynSQL-2.5M/databases",
    "spider": "spider/database",
    "bird": "bird/train/train_databases",
}
EXPLORE_TIMEOUT_S = 5.0   # an exploratory <sql> query
SCORE_TIMEOUT_S = 30.0    # the solution and the gold query, when scoring
_MAX_TABLE_CHARS = 9000   # a longer table is cut to its first 50 rows
_CUT_ROWS = 50

_SQL_BLOCK = re.compile(r"<sql>(.*?)</sql>", re.DOTALL)
_TAG_IN_SOLUTION = re.compile(r"</?(think|sql|observation)\b", re.IGNORECASE)
_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_OBSERVATION_END = re.compile(r"</observation>", re.IGNORECASE)


@dataclass(frozen=True)
class TransactionResult:
    """One statement run in a rolled-back transaction.

    rows: the fetched rows as a set (None when the statement failed); error: the exception text;
    timed_out: the time limit passed first (the statement was then interrupted, but ``rows`` keeps
    a result that arrived before the interrupt took effect, as skyrl-gym's scorer does).
    """

    rows: frozenset[tuple[Any, ...]] | None
    error: str | None
    timed_out: bool


def run_rolled_back(db_file: str, sql: str, timeout_s: float) -> TransactionResult:
    """Run one statement in a worker thread inside ``BEGIN TRANSACTION`` ... rollback; after
    ``timeout_s`` the connection is interrupted and the worker awaited."""
    outcome: dict[str, Any] = {"rows": None, "error": None}
    finished = threading.Event()
    opened: list[sqlite3.Connection] = []

    def work() -> None:
        connection = None
        try:
            connection = sqlite3.connect(db_file, check_same_thread=False)
            opened.append(connection)
            cursor = connection.cursor()
            connection.execute("BEGIN TRANSACTION;")
            cursor.execute(sql)
            rows = frozenset(cursor.fetchall())
            connection.rollback()
            outcome["rows"] = rows
        except Exception as exc:  # the model's SQL may fail in any way; that is its result
            outcome["error"] = str(exc)
        finally:
            if connection is not None:
                for end in (connection.rollback, connection.close):
                    try:
                        end()
                    except Exception:
                        pass
            finished.set()

    threading.Thread(target=work, daemon=True).start()
    timed_out = not finished.wait(timeout_s)
    if timed_out:
        for connection in opened:
            try:
                connection.interrupt()
            except Exception:
                pass
        finished.wait()
    return TransactionResult(rows=outcome["rows"], error=outcome["error"], timed_out=timed_out)


def _table(rows: frozenset[tuple[Any, ...]]) -> str:
    """Rows as skyrl-gym shows them: pandas' plain-text table (pandas comes with ``datasets``)."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    text = frame.to_string(index=False)
    if len(text) > _MAX_TABLE_CHARS:
        text = "Truncated to 50 lines since returned response too long: " + frame.head(_CUT_ROWS).to_string(index=False)
    return text


def sql_observation(db_file: str, sql: str | None, turns_left: int) -> str:
    """skyrl-gym's SQL tool output: the query's table, its error or a timeout note, or (no
    query) a request to follow the format, then a reminder of the turns left."""
    if sql is None:
        body = ("Your previous action is invalid. Follow the format of outputting thinking process and sql tool, "
                "and try again.")
    else:
        result = run_rolled_back(db_file, sql, EXPLORE_TIMEOUT_S)
        if result.timed_out:
            body = f"SQL Timeout:\n{sql}"
        elif result.rows is not None:
            body = _table(result.rows)
        else:
            body = f"Error executing SQL: {result.error}, db file: {db_file}"
    reminder = f"<reminder>You have {turns_left} turns left to complete the task.</reminder>"
    return f"\n\n<observation>{body}\n{reminder}</observation>\n\n"


def verified_solution(episode: str) -> str | None:
    """The stripped solution SQL of an episode's joined text, or None when its format is not
    skyrl-gym's (see the module docstring)."""
    if episode.count("<solution>") != 1:
        return None
    before, after = episode.split("<solution>", 1)
    if after.count("</solution>") != 1:
        return None
    solution = after.split("</solution>", 1)[0]
    if _TAG_IN_SOLUTION.search(solution) or _THINK_BLOCK.search(episode) is None:
        return None
    for end in _OBSERVATION_END.finditer(before):
        if not before[end.end():].lstrip().lower().startswith("<think>"):
            return None
    return solution.strip()


def _check_rows(extras: dict[str, Any]) -> None:
    missing = [key for key in ("db_id", "reward_spec", "data") if key not in extras]
    if missing:
        raise ValueError(
            f"text2sql env (skyrl-gym's) needs the row columns {missing}: db_id, data (one of "
            f"{', '.join(DATASET_FOLDERS)}) and reward_spec.ground_truth (the gold SQL); the row has "
            f"{sorted(extras)}. Rows of `ridgeline prepare text2sql` are for env_class text2sql_lenient."
        )
    if extras["data"] not in DATASET_FOLDERS:
        raise ValueError(f"text2sql env: the row's data must be one of {', '.join(DATASET_FOLDERS)} "
                         f"(it picks the database folder under db_path), got {extras['data']!r}")
    if not isinstance(extras["db_id"], str) or not extras["db_id"]:
        raise ValueError(f"text2sql env: the row's db_id must name a database, got {extras['db_id']!r}")


@register("text2sql")
class Text2SQLEnv(Env):
    """skyrl-gym's SQL env; see the module docstring. Setting: ``db_path``."""

    accepted_settings = ("db_path",)

    def __init__(self, extras: dict[str, Any] | None = None, *, db_path: str = DEFAULT_DB_PATH,
                 max_turns: int | None = None, **settings: Any) -> None:
        extras = dict(extras or {})
        super().__init__(extras, max_turns=skyrl_max_turns(extras, max_turns), **settings)
        _check_rows(self.extras)
        self.gold_sql = skyrl_ground_truth(self.extras, "text2sql")
        self.db_id: str = self.extras["db_id"]
        self.db_file = os.path.join(str(db_path), DATASET_FOLDERS[self.extras["data"]], self.db_id,
                                    self.db_id + ".sqlite")
        if not os.path.exists(self.db_file):
            raise FileNotFoundError(
                f"text2sql: database file not found: {self.db_file} (from environment.skyrl_gym.text2sql.db_path="
                f"{db_path!r}, the row's data={self.extras['data']!r} and db_id={self.db_id!r})"
            )
        self.messages: list[str] = []  # every response and observation of the episode, in order

    def step(self, action: str) -> StepOutput:
        last = self.next_turn()
        self.messages.append(action)
        if last or ("<solution>" in action and "</solution>" in action):
            solution = verified_solution("".join(self.messages))
            metadata = {"parsed": solution, "ground_truth": self.gold_sql}
            return StepOutput(observations=[], reward=self._score(solution), done=True, metadata=metadata)
        block = _SQL_BLOCK.search(action)
        query = None if block is None else block.group(1)
        try:
            observation = sql_observation(self.db_file, query, self.max_turns - self.turns)
        except Exception as exc:  # skyrl-gym shows a failing tool's error text as the observation
            observation = str(exc)
        if not observation:
            return StepOutput(observations=[], reward=0.0, done=False, metadata={"sql": query})
        self.messages.append(observation)
        return StepOutput(observations=[{"role": "user", "content": observation}], reward=0.0, done=False,
                          metadata={"sql": query})

    def _score(self, solution: str | None) -> float:
        if solution is None:
            return -1.0
        try:
            predicted = run_rolled_back(self.db_file, solution, SCORE_TIMEOUT_S).rows
            gold = run_rolled_back(self.db_file, self.gold_sql, SCORE_TIMEOUT_S).rows
        except Exception:  # e.g. no thread could be started; skyrl-gym scores 0 then
            logger.warning("text2sql: scoring failed; reward 0", exc_info=True)
            return 0.0
        return 1.0 if predicted is not None and gold is not None and predicted == gold else 0.0
