"""``text2sql_lenient``: Ridgeline's multi-turn text-to-SQL on real SQLite databases.

The SkyRL-SQL protocol with forgiving reading, hardened execution and no format penalty; the
``text2sql`` env is skyrl-gym's own, exactly (:mod:`ridgeline.envs.text2sql`).

Each turn the model either explores or answers:

* ``<sql>QUERY</sql>``: the env runs QUERY (the last such block of the response) read-only and
  replies with ``<observation>...</observation>`` holding the first rows as a small table, or the
  error. Reward 0, the episode goes on.
* ``<solution>QUERY</solution>``: the final answer. QUERY's result is compared with the gold
  query's result over all their rows (:func:`~ridgeline.envs.sql_executor.same_result`: rows as
  a multiset, in order only when the gold query ends in ORDER BY, floats to 9 significant
  digits). Reward 1.0 on a match, else 0.0 (a failed query, a timeout or a result over a limit
  included); the episode ends.
* neither: an observation restating the format, reward 0.

On the last allowed turn (``max_turns``, default 5) the episode ends whatever the response; an
``<sql>`` block there is scored as the answer. ``<think>...</think>`` sections are ignored, so tags
quoted while reasoning do not count.

Dataset row (SkyRL schema): ``reward_spec.ground_truth`` = the gold SQL; ``extra_info.db_id``
names the database, found as ``<db_root>/<db_id>.sqlite`` or ``<db_root>/<db_id>/<db_id>.sqlite``
(the Spider/BIRD layout); ``extra_info.db_path`` may give the file instead (absolute, or relative
to ``db_root``).

Settings (``environment.skyrl_gym.text2sql_lenient``): ``db_root``, ``timeout_s`` (5: per query),
``max_rows`` (1000: rows of each result kept in memory, for the observation and the metadata;
the answer check covers every row), ``observation_rows`` (10: rows shown to the model),
``max_value_bytes`` / ``max_result_bytes`` (:class:`~ridgeline.envs.sql_executor.SQLLimits`),
``max_turns``.

Reading is linear in the response's length (literal searches, no pattern that can backtrack),
so no response can stall the process.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .base import Env, StepOutput
from .registry import register
from .sql_executor import QueryResult, SQLCounts, SQLLimits, has_top_level_order_by, run_query, same_result

__all__ = ["Text2SQLLenientEnv", "extract_tag", "format_observation"]

logger = logging.getLogger(__name__)

# Literal patterns only: each search is linear, and every loop below moves forward.
_THINK_OPEN = re.compile("<think>", re.IGNORECASE)
_THINK_CLOSE = re.compile("</think>", re.IGNORECASE)
_TAG_OPEN = {tag: re.compile(f"<{tag}>", re.IGNORECASE) for tag in ("sql", "solution")}
_TAG_CLOSE = {tag: re.compile(f"</{tag}>", re.IGNORECASE) for tag in ("sql", "solution")}
# Matched at position 0 only; [A-Za-z]* and the spaces after it cannot overlap, so no backtracking.
_LEADING_FENCE = re.compile(r"\s*```[A-Za-z]*\s*\n?")

_MAX_CELL_CHARS = 60
_MAX_OBSERVATION_CHARS = 3000

FORMAT_REMINDER = (
    "No <sql> or <solution> block found. Write one SQLite query inside <sql>...</sql> to run it and "
    "see its result, or give your final query inside <solution>...</solution>."
)


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>`` block outside ``<think>...</think>`` (None if there
    is none; a block may be left open at the end: generation often stops on ``</sql>`` without
    including it), with surrounding whitespace and Markdown code fences removed. Tags match in
    any case. Linear time in ``len(text)``."""
    text = _without_think(text)
    opening, closing = _TAG_OPEN[tag], _TAG_CLOSE[tag]
    content = None
    position = 0
    while (start := opening.search(text, position)) is not None:
        end = closing.search(text, start.end())
        if end is None:
            content = text[start.end():]
            break
        content = text[start.end():end.start()]
        position = end.end()
    return None if content is None else _strip_fences(content)


def _without_think(text: str) -> str:
    """``text`` without its ``<think>...</think>`` sections (an unclosed ``<think>`` stays)."""
    kept = []
    position = 0
    while (start := _THINK_OPEN.search(text, position)) is not None:
        end = _THINK_CLOSE.search(text, start.end())
        if end is None:
            break  # no later <think> has a closing tag either
        kept.append(text[position:start.start()])
        position = end.end()
    kept.append(text[position:])
    return "".join(kept)


def _strip_fences(block: str) -> str:
    """Without a leading ```` ```sql ```` line and a trailing ```` ``` ````, then stripped."""
    leading = _LEADING_FENCE.match(block)
    if leading is not None:
        block = block[leading.end():]
    trimmed = block.rstrip()
    if trimmed.endswith("```"):
        block = trimmed[: -len("```")]
    return block.strip()


def _format_cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        text = repr(value)  # keeps "24.0" distinct from the integer 24
    elif isinstance(value, (bytes, bytearray)):
        text = f"<blob {len(value)} bytes>"
    else:
        text = str(value)
    text = " ".join(text.split()).replace("|", "\\|")  # one line per row; '|' would split cells
    return text if len(text) <= _MAX_CELL_CHARS else text[: _MAX_CELL_CHARS - 3] + "..."


def format_observation(result: QueryResult, observation_rows: int) -> str:
    """A query result as the model sees it: a Markdown table of the first ``observation_rows``
    rows plus a line saying how many there were, or the error; at most ~3000 characters."""
    if result.rows is None:
        body = f"Error: {result.error_type + ': ' if result.error_type else ''}{result.error}"
    elif not result.rows:
        body = "Query returned no rows."
        if result.columns:
            body += " Columns: " + ", ".join(result.columns)
    else:
        shown = result.rows[:observation_rows]
        lines = ["| " + " | ".join(_format_cell(c) for c in result.columns) + " |",
                 "|" + " --- |" * len(result.columns)]
        lines += ["| " + " | ".join(_format_cell(v) for v in row) + " |" for row in shown]
        total = str(result.row_count) if result.complete else f"more than {len(result.rows)}"
        if len(shown) < result.row_count:
            lines.append(f"({len(shown)} of {total} rows shown)")
        else:
            lines.append(f"({result.row_count} row{'s' if result.row_count != 1 else ''})")
        body = "\n".join(lines)
    if len(body) > _MAX_OBSERVATION_CHARS:
        body = body[:_MAX_OBSERVATION_CHARS] + "\n... (output cut)"
    return f"<observation>\n{body}\n</observation>"


# ---------------------------------------------------------------------------------------------
# Gold results: many rollouts share one prompt (GRPO groups), so the gold query runs once per
# (database file version, gold SQL, limits) per process.

_GOLD_CACHE_SIZE = 1024
_gold_cache: OrderedDict[tuple[Any, ...], QueryResult] = OrderedDict()
_gold_lock = threading.Lock()


def gold_result(db_path: Path, gold_sql: str, *, limits: SQLLimits, max_rows: int) -> QueryResult:
    """The gold query's result, from a process-wide LRU cache. The key includes the file's size
    and modification time, so a rebuilt database is not served stale results. Timeouts are not
    cached: they may come from a busy machine rather than the query."""
    stat = db_path.stat()
    key = (str(db_path.resolve()), stat.st_size, stat.st_mtime_ns, gold_sql, limits, int(max_rows))
    with _gold_lock:
        cached = _gold_cache.get(key)
        if cached is not None:
            _gold_cache.move_to_end(key)
            return cached
    result = run_query(db_path, gold_sql, max_rows=max_rows, limits=limits)
    if not result.ok:
        logger.warning("text2sql_lenient: gold SQL fails on %s (%s): %s", db_path, result.error, gold_sql)
    if not result.timed_out:
        with _gold_lock:
            _gold_cache[key] = result
            while len(_gold_cache) > _GOLD_CACHE_SIZE:
                _gold_cache.popitem(last=False)
    return result


def clear_gold_cache() -> None:
    with _gold_lock:
        _gold_cache.clear()


# ---------------------------------------------------------------------------------------------


def _resolve_db_path(extras: dict[str, Any], db_root: str | Path | None) -> Path:
    """Where the row's database file is; raises on configuration/data errors (not model errors)."""
    info = extras.get("extra_info") or {}
    explicit = info.get("db_path") if isinstance(info, dict) else None
    db_id = info.get("db_id") if isinstance(info, dict) else None
    if explicit:
        path = Path(str(explicit)).expanduser()
        if not path.is_absolute():
            if db_root is None:
                raise ValueError(
                    f"text2sql_lenient: extra_info.db_path {explicit!r} is relative; set "
                    "environment.skyrl_gym.text2sql_lenient.db_root or give an absolute path"
                )
            path = Path(db_root).expanduser() / path
    else:
        if not isinstance(db_id, str) or not db_id:
            raise ValueError(
                f"text2sql_lenient env needs extra_info.db_id (or extra_info.db_path); got extra_info={info!r}")
        if db_root is None:
            raise ValueError(
                "text2sql_lenient env needs the database folder: set environment.skyrl_gym.text2sql_lenient.db_root "
                f"(the folder holding {db_id}.sqlite)"
            )
        root = Path(db_root).expanduser()
        candidates = [root / f"{db_id}.sqlite", root / db_id / f"{db_id}.sqlite"]
        path = next((c for c in candidates if c.is_file()), candidates[0])
        if not path.is_file():
            raise FileNotFoundError(
                f"text2sql_lenient: database {db_id!r} not found; looked for {candidates[0]} and {candidates[1]}"
            )
    if not path.is_file():
        raise FileNotFoundError(f"text2sql_lenient: database file not found: {path}")
    return path


def _gold_sql(extras: dict[str, Any]) -> str:
    spec = extras.get("reward_spec")
    gold = spec.get("ground_truth") if isinstance(spec, dict) else None
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(
            "text2sql_lenient env needs the gold SQL in extras['reward_spec']['ground_truth'] "
            f"(dataset column reward_spec = {{'method': 'rule', 'ground_truth': 'SELECT ...'}}); "
            f"got reward_spec={spec!r}"
        )
    return gold


@register("text2sql_lenient")
class Text2SQLLenientEnv(Env):
    """Multi-turn text-to-SQL env; see the module docstring for the protocol.

    Construction fails (ValueError/FileNotFoundError) when the row or config is unusable: no
    gold SQL, no database id, no ``db_root``, a missing database file. ``step`` never raises on
    model text.

    Metrics per episode (:meth:`get_metrics`): ``sql_calls`` (queries of the model that were run,
    exploration and answer), ``sql_errors`` (of those, the ones that failed), by reason
    ``timeouts``, ``refused``, ``too_large``, ``crashed``, and ``solved`` (1.0 when the answer
    matched).
    """

    accepted_settings = ("db_root", "timeout_s", "max_rows", "observation_rows", "max_value_bytes",
                         "max_result_bytes")
    default_max_turns = 5

    def __init__(self, extras: dict[str, Any] | None = None, *, db_root: str | Path | None = None,
                 timeout_s: float = 5.0, max_rows: int = 1000, observation_rows: int = 10,
                 max_value_bytes: int = SQLLimits.max_value_bytes,
                 max_result_bytes: int = SQLLimits.max_result_bytes, **settings: Any) -> None:
        super().__init__(extras, **settings)
        if int(max_rows) < 1 or int(observation_rows) < 0:
            raise ValueError(f"text2sql_lenient: need max_rows >= 1 and observation_rows >= 0, "
                             f"got {max_rows!r}, {observation_rows!r}")
        try:
            self.limits = SQLLimits(timeout_s=float(timeout_s), max_value_bytes=int(max_value_bytes),
                                    max_result_bytes=int(max_result_bytes))
        except ValueError as exc:
            raise ValueError(f"text2sql_lenient: {exc}") from None
        self.max_rows = int(max_rows)
        self.observation_rows = int(observation_rows)
        self.gold_sql = _gold_sql(self.extras)
        self.db_path = _resolve_db_path(self.extras, db_root)
        self.order_matters = has_top_level_order_by(self.gold_sql)
        self._gold: QueryResult | None = None
        self.counts = SQLCounts()
        self.solved = False

    # -- protocol ----------------------------------------------------------------------------

    def step(self, action: str) -> StepOutput:
        text = action if isinstance(action, str) else ("" if action is None else str(action))
        last_turn = self.next_turn()
        solution = extract_tag(text, "solution")
        if solution is not None:
            return self._answer(solution, source="solution")
        query = extract_tag(text, "sql")
        if query is not None and last_turn:
            return self._answer(query, source="sql_on_last_turn")
        if query is not None:
            return self._explore(query)
        metadata = {"kind": "no_tags", "turn": self.turns}
        if last_turn:
            return StepOutput(observations=[], reward=0.0, done=True, metadata=metadata)
        return StepOutput(observations=[self._message(f"<observation>\n{FORMAT_REMINDER}\n</observation>")],
                          reward=0.0, done=False, metadata=metadata)

    def _explore(self, query: str) -> StepOutput:
        result = self._run(query, digest=False)  # a look at the data: the first max_rows + 1 rows do
        metadata = {"kind": "explore", "sql": query, "turn": self.turns, **self._result_metadata(result)}
        observation = format_observation(result, self.observation_rows)
        return StepOutput(observations=[self._message(observation)], reward=0.0, done=False, metadata=metadata)

    def _answer(self, query: str, *, source: str) -> StepOutput:
        result = self._run(query, digest=True)
        gold = self.gold()
        solved = same_result(result, gold, order_matters=self.order_matters)
        self.solved = solved
        metadata: dict[str, Any] = {
            "kind": source,
            "sql": query,
            "turn": self.turns,
            "ground_truth": self.gold_sql,
            "order_matters": self.order_matters,
            **self._result_metadata(result),
        }
        if not gold.ok:
            metadata["gold_error"] = gold.error
        return StepOutput(observations=[], reward=1.0 if solved else 0.0, done=True, metadata=metadata)

    # -- helpers -----------------------------------------------------------------------------

    def unscorable(self) -> str | None:
        gold = self.gold()
        if not gold.ok and not gold.timed_out:  # a timeout may be a busy machine, not the query
            return f"its gold SQL (reward_spec.ground_truth) fails on {self.db_path}: {gold.error}"
        return None

    def gold(self) -> QueryResult:
        """The gold query's result (computed on first use, then cached)."""
        if self._gold is None:
            self._gold = gold_result(self.db_path, self.gold_sql, limits=self.limits, max_rows=self.max_rows)
        return self._gold

    def _run(self, query: str, *, digest: bool) -> QueryResult:
        result = run_query(self.db_path, query, max_rows=self.max_rows, limits=self.limits, digest=digest)
        self.counts.add(result.failure)
        return result

    def _message(self, observation: str) -> dict[str, str]:
        if self.turns == self.max_turns - 1:
            observation += "\nYour next response is your last: give your final query inside <solution>...</solution>."
        return {"role": "user", "content": observation}

    @staticmethod
    def _result_metadata(result: QueryResult) -> dict[str, Any]:
        return {
            "error": result.error,
            "failure": result.failure,
            "num_rows": None if result.rows is None or not result.complete else result.row_count,
            "truncated": result.truncated,
            "timed_out": result.timed_out,
        }

    def get_metrics(self) -> dict[str, float]:
        return {**self.counts.metrics(), "solved": float(self.solved)}
