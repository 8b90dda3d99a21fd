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

An exploratory query's rows only make that observation, so the worker sends back a preview
(:data:`PREVIEW`): the first 4501 rows within 512 KiB, each text and blob cut to 9000
characters; reading stops there, in the worker. Every table skyrl-gym shows whole (at most 9000
characters) fits in it and is shown the same; a longer one is cut the way skyrl-gym cuts it
("Truncated to 50 lines ...", its first 50 rows), from the preview's rows, and the observation
is at most :data:`MAX_OBSERVATION_CHARS`. Before, one ``<sql>`` step returning 7 cells of 8 MB
kept a 64 MB observation for the episode and took the trainer from 134 to 498 MiB.

Queries run as skyrl-gym runs them, inside a transaction that is always rolled back, so a write
does run (and its empty result can match an empty gold result) but, here, never reaches the
file: :func:`ridgeline.envs.sql_executor.run_in_rollback` runs it in a worker process with the
journal in memory, bounded in time (a single long function call included), value length
(``max_value_bytes``) and result size (``max_result_bytes``), and refuses ATTACH, extension
loading and process-wide pragmas. A result over a limit is an error like any other (0 when
scoring); metrics count each reason. ``text2sql_lenient`` runs queries read-only instead.

Reading is linear in the text's length (``str.find`` and fixed-width checks, no regex that can
backtrack), so no response can stall the process.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace
from typing import Any

from .base import Env, StepOutput
from .registry import register
from .skyrl_rules import skyrl_ground_truth, skyrl_max_turns
from .sql_executor import Preview, SQLCounts, SQLLimits, run_in_rollback

__all__ = [
    "DATASET_FOLDERS",
    "DEFAULT_DB_PATH",
    "Text2SQLEnv",
    "TransactionResult",
    "first_sql_block",
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
# past 4500 rows a table is always longer than 9000 characters, and so is one with a cell longer than 9000;
# 4500 rows of 9000 characters in all take at most ~480 KiB as Python objects
PREVIEW = Preview(rows=_MAX_TABLE_CHARS // 2 + 1, bytes=512 * 1024, cell_chars=_MAX_TABLE_CHARS)
MAX_OBSERVATION_CHARS = 100_000  # generator.max_observation_chars' default: no more reaches the model

_TAG_IN_SOLUTION = re.compile(r"</?(think|sql|observation)\b", re.IGNORECASE)
_OBSERVATION_END = re.compile(r"</observation>", re.IGNORECASE)
_SPACE = re.compile(r"\s*")  # str.lstrip's whitespace (both use Py_UNICODE_ISSPACE)


@dataclass(frozen=True)
class TransactionResult:
    """One statement run in a rolled-back transaction.

    rows: the rows as a set (None when the statement failed); error: the exception text (or the
    executor's reason: a limit, a refusal); timed_out: the time limit passed first; failure: the
    executor's reason (:class:`~ridgeline.envs.sql_executor.QueryResult`).
    """

    rows: frozenset[tuple[Any, ...]] | None
    error: str | None
    timed_out: bool
    failure: str | None = None
    complete: bool = True  # False: a preview, more rows than it holds


def run_rolled_back(db_file: str, sql: str, limits: SQLLimits, preview: Preview | None = None) -> TransactionResult:
    """Run one statement inside ``BEGIN TRANSACTION`` ... rollback under ``limits``; the rows as
    skyrl-gym keeps them (``frozenset(cursor.fetchall())``), or with ``preview`` those of the
    preview."""
    result = run_in_rollback(db_file, sql, limits, preview)
    rows = None if result.rows is None else frozenset(result.rows)
    return TransactionResult(rows=rows, error=result.error, timed_out=result.timed_out, failure=result.failure,
                             complete=result.rows is None or not result.truncated)


def _table(rows: frozenset[tuple[Any, ...]], complete: bool = True) -> str:
    """Rows as skyrl-gym shows them: pandas' plain-text table (pandas comes with ``datasets``),
    cut to its first 50 rows past 9000 characters. Every row line is at least one character and a
    newline, so past 4500 rows the whole table is never rendered: the frame is still built from
    all rows (it sets the column types the first 50 rows print with). An incomplete preview is
    always cut. The text is at most MAX_OBSERVATION_CHARS."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    if complete and 2 * len(rows) <= _MAX_TABLE_CHARS:
        text = frame.to_string(index=False)
        if len(text) <= _MAX_TABLE_CHARS:
            return text
    text = "Truncated to 50 lines since returned response too long: " + frame.head(_CUT_ROWS).to_string(index=False)
    return text[:MAX_OBSERVATION_CHARS]


def sql_observation(db_file: str, sql: str | None, turns_left: int, limits: SQLLimits,
                    counts: SQLCounts | None = None) -> str:
    """skyrl-gym's SQL tool output: the query's table, its error or a timeout note, or (no
    query) a request to follow the format, then a reminder of the turns left. ``limits`` gives
    the bounds (its timeout is replaced by :data:`EXPLORE_TIMEOUT_S`); ``counts`` counts the query."""
    if sql is None:
        body = ("Your previous action is invalid. Follow the format of outputting thinking process and sql tool, "
                "and try again.")
    else:
        result = run_rolled_back(db_file, sql, replace(limits, timeout_s=EXPLORE_TIMEOUT_S), PREVIEW)
        if counts is not None:
            counts.add(result.failure)
        if result.timed_out:
            body = f"SQL Timeout:\n{sql}"
        elif result.rows is not None:
            body = _table(result.rows, result.complete)
        else:
            body = f"Error executing SQL: {result.error}, db file: {db_file}"
    reminder = f"<reminder>You have {turns_left} turns left to complete the task.</reminder>"
    return f"\n\n<observation>{body}\n{reminder}</observation>\n\n"


def first_sql_block(action: str) -> str | None:
    """skyrl-gym's ``re.search(r"<sql>(.*?)</sql>", action, re.DOTALL)`` group, in linear time:
    the first ``<sql>`` that has a ``</sql>`` after it is the first ``<sql>`` of all (a later one
    has fewer closings after it), and the block ends at the first ``</sql>`` after it."""
    start = action.find("<sql>")
    if start < 0:
        return None
    end = action.find("</sql>", start + len("<sql>"))
    return None if end < 0 else action[start + len("<sql>"):end]


def verified_solution(episode: str) -> str | None:
    """The stripped solution SQL of an episode's joined text, or None when its format is not
    skyrl-gym's (see the module docstring). Linear time: skyrl-gym's ``<think>(.*?)</think>``
    search and its copy of the rest of the text after each ``</observation>`` are quadratic."""
    if episode.count("<solution>") != 1:
        return None
    before, after = episode.split("<solution>", 1)
    if after.count("</solution>") != 1:
        return None
    solution = after.split("</solution>", 1)[0]
    if _TAG_IN_SOLUTION.search(solution) or not _has_think_block(episode):
        return None
    for end in _OBSERVATION_END.finditer(before):
        # skyrl-gym: before[end:].lstrip().lower().startswith("<think>"). lower() maps one
        # character to one or more, so the first 7 characters after the spaces decide it.
        space = _SPACE.match(before, end.end())
        start = space.end() if space is not None else end.end()  # `\s*` always matches
        if not before[start:start + len("<think>")].lower().startswith("<think>"):
            return None
    return solution.strip()


def _has_think_block(text: str) -> bool:
    """Whether ``<think>(.*?)</think>`` (DOTALL) matches anywhere: the first ``<think>`` has the
    most text after it, so it decides."""
    start = text.find("<think>")
    return start >= 0 and text.find("</think>", start + len("<think>")) >= 0


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
    """skyrl-gym's SQL env; see the module docstring. Settings: ``db_path``, and the bounds
    ``max_value_bytes`` / ``max_result_bytes`` (:class:`~ridgeline.envs.sql_executor.SQLLimits`).

    Metrics per episode: ``sql_calls`` (the model's queries run: explorations and the
    solution), ``sql_errors`` (of those, the failed ones) and by reason ``timeouts``,
    ``refused``, ``too_large``, ``crashed``."""

    accepted_settings = ("db_path", "max_value_bytes", "max_result_bytes")

    def __init__(self, extras: dict[str, Any] | None = None, *, db_path: str = DEFAULT_DB_PATH,
                 max_turns: int | None = None, max_value_bytes: int = SQLLimits.max_value_bytes,
                 max_result_bytes: int = SQLLimits.max_result_bytes, **settings: Any) -> None:
        extras = dict(extras or {})
        super().__init__(extras, max_turns=skyrl_max_turns(extras, max_turns), **settings)
        _check_rows(self.extras)
        self.limits = SQLLimits(timeout_s=SCORE_TIMEOUT_S, max_value_bytes=int(max_value_bytes),
                                max_result_bytes=int(max_result_bytes))
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
        self.counts = SQLCounts()

    def step(self, action: str) -> StepOutput:
        last = self.next_turn()
        self.messages.append(action)
        if last or ("<solution>" in action and "</solution>" in action):
            solution = verified_solution("".join(self.messages))
            metadata = {"parsed": solution, "ground_truth": self.gold_sql}
            return StepOutput(observations=[], reward=self._score(solution), done=True, metadata=metadata)
        query = first_sql_block(action)
        try:
            observation = sql_observation(self.db_file, query, self.max_turns - self.turns, self.limits, self.counts)
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
            predicted = run_rolled_back(self.db_file, solution, self.limits)
            self.counts.add(predicted.failure)
            gold = run_rolled_back(self.db_file, self.gold_sql, self.limits).rows
        except Exception:  # e.g. no worker could be started; skyrl-gym scores 0 then
            logger.warning("text2sql: scoring failed; reward 0", exc_info=True)
            return 0.0
        return 1.0 if predicted.rows is not None and gold is not None and predicted.rows == gold else 0.0

    def unscorable(self) -> str | None:
        gold = run_rolled_back(self.db_file, self.gold_sql, self.limits)
        if gold.rows is None and not gold.timed_out:  # a timeout may be a busy machine, not the query
            return f"its gold SQL (reward_spec.ground_truth) fails on {self.db_file}: {gold.error}"
        return None

    def get_metrics(self) -> dict[str, float]:
        return self.counts.metrics()
