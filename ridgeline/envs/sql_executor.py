"""Run model-written SQL against a real SQLite file, bounded, and compare result sets.

Model text is untrusted: it may try to write, to create files, to run for minutes inside one
function call or to build gigabytes. :func:`run_query` (``text2sql_lenient``: read-only) and
:func:`run_in_rollback` (skyrl-gym's ``text2sql``: any statement, inside a transaction that is
always rolled back) hand each statement to a worker process (:mod:`ridgeline.envs.sql_worker`,
where the SQLite-level guards are described) and wait for it until the time limit plus
``KILL_GRACE_S``; a worker still busy then is killed and replaced. So:

* time: a statement ends at ``timeout_s`` (SQLite's progress handler) or, inside one long
  function call where SQLite never checks, the process dies at ``timeout_s + KILL_GRACE_S``;
* memory: SQLite refuses any value longer than ``max_value_bytes``; rows are charged one at a
  time against ``max_result_bytes`` before they are kept; the worker process is capped at
  ``worker_memory_bytes(limits)`` (RLIMIT_AS) and its files (SQLite's temp files) at 2 GiB each;
  this process only ever receives a reply of bounded size, decoded without running any code;
* the database: see the worker's modes; the file's bytes never change in either.

Workers are reused (one per statement in flight, started on demand, ~15 ms each), die with this
process (EOF on their stdin, and a parent check each second), and are dropped in a forked child.
Answers are compared in full: :class:`QueryResult` carries digests over every row, whatever
``max_rows`` it keeps for display (:func:`same_result`).
"""

from __future__ import annotations

import atexit
import os
import pickle
import re
import selectors
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import sql_worker
from .sql_worker import CRASHED, READ_ONLY, ROLLED_BACK, TIMEOUT, Reply, Request, RowDigest

__all__ = ["KILL_GRACE_S", "Preview", "QueryResult", "SQLCounts", "SQLLimits", "has_top_level_order_by",
           "results_match", "run_in_rollback", "run_query", "same_result", "worker_memory_bytes"]

MiB = 1024 * 1024
KILL_GRACE_S = 0.5          # after timeout_s, how long a worker has to answer before it is killed
_START_TIMEOUT_S = 30.0     # a fresh worker says it is ready within this (a busy machine is slow)
_MAX_FILE_BYTES = 2048 * MiB  # RLIMIT_FSIZE of a worker: any one SQLite temp file
_WORKER_BASE_MEMORY = 256 * MiB  # an idle worker maps ~100 MiB (interpreter, SQLite, one thread)
_MAX_IDLE_WORKERS = 32
_WORKER_SCRIPT = str(Path(sql_worker.__file__).resolve())


@dataclass(frozen=True)
class SQLLimits:
    """Bounds of one statement.

    timeout_s: wall time; max_value_bytes: the longest string/blob/row record SQLite may build
    or read (``SQLITE_LIMIT_LENGTH``); max_result_bytes: the memory the kept rows may take
    (Python object sizes, counted row by row).
    """

    timeout_s: float = 5.0
    max_value_bytes: int = 8 * MiB
    max_result_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"SQL timeout_s must be positive, got {self.timeout_s!r}. Fix: e.g. timeout_s: 5")
        if not 1024 <= self.max_value_bytes <= 1_000_000_000:
            raise ValueError(f"SQL max_value_bytes must be between 1024 and 1e9, got {self.max_value_bytes!r}. "
                             f"Fix: e.g. max_value_bytes: {8 * MiB} (8 MiB)")
        if not MiB <= self.max_result_bytes <= 4096 * MiB:
            raise ValueError(f"SQL max_result_bytes must be between 1 MiB and 4 GiB, got {self.max_result_bytes!r}. "
                             f"Fix: e.g. max_result_bytes: {64 * MiB} (64 MiB)")


def worker_memory_bytes(limits: SQLLimits) -> int:
    """RLIMIT_AS of the worker that runs statements under ``limits``: the kept rows, their
    encoded copy and room for SQLite's caches, one large row and the interpreter."""
    return _WORKER_BASE_MEMORY + 3 * limits.max_result_bytes + 8 * limits.max_value_bytes


@dataclass
class QueryResult:
    """Outcome of one statement; exactly one of ``rows``/``error`` is set.

    rows: the first ``max_rows`` result rows as tuples of Python values (int, float, str, bytes,
        None); None when the statement failed.
    columns: result column names (empty when it failed or returns no columns).
    row_count: how many rows were read: all the statement returned when ``complete``, else
        ``max_rows + 1`` (there were more; only a digested result reads them all).
    ordered, unordered: digests of all rows when asked for (:class:`~ridgeline.envs.sql_worker.RowDigest`).
    failure: None, or why there are no rows: ``sql_error``, ``refused``, ``timeout``, ``too_large``
        or ``crashed`` (the worker process died).
    error: a one-line message when it failed; error_type: SQLite's exception class, "" for the
        executor's own refusals and limits.
    elapsed_s: wall time, including waiting for a worker.
    """

    rows: list[tuple[Any, ...]] | None
    columns: list[str] = field(default_factory=list)
    row_count: int = 0
    complete: bool = False
    ordered: bytes = field(default=b"", repr=False)
    unordered: bytes = field(default=b"", repr=False)
    failure: str | None = None
    error: str | None = None
    error_type: str = ""
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def timed_out(self) -> bool:
        return self.failure == TIMEOUT

    @property
    def truncated(self) -> bool:
        """More rows existed than were kept."""
        return self.rows is not None and self.row_count > len(self.rows)


@dataclass
class SQLCounts:
    """Per-episode counts of the model's queries, for an env's ``get_metrics``: ``sql_calls``,
    ``sql_errors`` (every failed one) and the failures by reason: ``timeouts``, ``refused``,
    ``too_large``, ``crashed`` (an ``sql_error`` proper is the rest)."""

    calls: int = 0
    errors: int = 0
    by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_REASON_METRICS.values(), 0))

    def add(self, failure: str | None) -> None:
        self.calls += 1
        if failure is not None:
            self.errors += 1
            metric = _REASON_METRICS.get(failure)
            if metric is not None:
                self.by_reason[metric] += 1

    def metrics(self) -> dict[str, float]:
        return {"sql_calls": float(self.calls), "sql_errors": float(self.errors),
                **{name: float(count) for name, count in self.by_reason.items()}}


_REASON_METRICS = {TIMEOUT: "timeouts", sql_worker.REFUSED: "refused", sql_worker.TOO_LARGE: "too_large",
                   CRASHED: "crashed"}


def run_query(db_path: str | Path, sql: str, *, max_rows: int = 1000, limits: SQLLimits = SQLLimits(),
              digest: bool = True) -> QueryResult:
    """Execute one read-only statement on the SQLite file ``db_path``.

    Guarantees: the file's bytes are never changed and no file is created by anything the SQL
    does; only one statement runs (a second one is an error, trailing semicolons and comments
    are fine; it must start with SELECT, WITH, VALUES or PRAGMA); the call returns within about
    ``limits.timeout_s + KILL_GRACE_S``; the first ``max_rows`` rows come back. With ``digest``
    every row is read and digested (an answer to compare: :func:`same_result`); without, reading
    stops after ``max_rows + 1`` rows (a look at the data). Bad, refused, slow or oversized SQL
    gives a result with ``error`` and ``failure`` set; it never raises for anything in ``sql``.

    Raises:
        FileNotFoundError: ``db_path`` is not an existing file (a configuration error, not the
            model's fault, so it must not turn into a quiet zero reward).
        OSError: the file exists but SQLite cannot open it (permissions).
        ValueError: ``max_rows`` is not positive.
        RuntimeError: no worker process can be started.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows!r}")
    result = _run(READ_ONLY, db_path, sql, limits, keep_rows=max_rows, digest=digest)
    if result.failure == sql_worker.UNOPENABLE:
        raise OSError(f"cannot open SQLite database {db_path} read-only: {result.error}")
    return result


@dataclass(frozen=True)
class Preview:
    """What an exploratory query sends back when its rows only make an observation: at most
    ``rows`` rows taking ``bytes`` (Python sizes), each text and blob cut to ``cell_chars``;
    reading stops there (``QueryResult.complete`` false), in the worker, so the trainer never
    holds more."""

    rows: int
    bytes: int
    cell_chars: int


def run_in_rollback(db_path: str | Path, sql: str, limits: SQLLimits, preview: Preview | None = None) -> QueryResult:
    """Execute one statement of any kind inside ``BEGIN TRANSACTION`` ... rollback, as skyrl-gym's
    SQL env does, keeping every row (more than ``limits.max_result_bytes`` of them is a
    ``too_large`` failure), or with ``preview`` the first rows within its bounds. Writes run but
    never reach the file; ATTACH, extension loading and process-wide pragmas are refused. No
    digests (skyrl-gym compares the rows as sets).

    Raises FileNotFoundError / RuntimeError as :func:`run_query` does.
    """
    return _run(ROLLED_BACK, db_path, sql, limits, keep_rows=None if preview is None else preview.rows, digest=False,
                preview=preview)


def _run(mode: str, db_path: str | Path, sql: str, limits: SQLLimits, *, keep_rows: int | None,
         digest: bool, preview: Preview | None = None) -> QueryResult:
    started = time.monotonic()
    path = Path(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"SQLite database not found: {path} (resolved to {path.resolve()})")
    if not isinstance(sql, str):
        return QueryResult(rows=None, failure=sql_worker.SQL_ERROR,
                           error=f"query must be a string, got {type(sql).__name__}")
    budget = limits.max_result_bytes if preview is None else min(preview.bytes, limits.max_result_bytes)
    request = Request(mode, str(path.resolve()), sql, float(limits.timeout_s), keep_rows, int(limits.max_value_bytes),
                      int(budget), digest, preview is not None, None if preview is None else preview.cell_chars)
    reply = _pool(worker_memory_bytes(limits)).run(request, limits)
    return QueryResult(rows=reply.rows, columns=list(reply.columns), row_count=reply.row_count,
                       complete=reply.complete, ordered=reply.ordered, unordered=reply.unordered,
                       failure=reply.failure, error=reply.error, error_type=reply.error_type,
                       elapsed_s=time.monotonic() - started)


# ---------------------------------------------------------------------------------------------
# Worker processes


class _Worker:
    """One ``sql_worker.py`` process and its pipes; used by one thread at a time."""

    def __init__(self, memory_bytes: int) -> None:
        env = {"MALLOC_ARENA_MAX": "2"}  # fewer malloc arenas: less address space under RLIMIT_AS
        for name in ("TMPDIR", "SQLITE_TMPDIR"):  # where SQLite puts its temp files
            if name in os.environ:
                env[name] = os.environ[name]
        try:
            self.proc = subprocess.Popen(
                [_interpreter(), "-I", "-S", "-B", _WORKER_SCRIPT, str(memory_bytes), str(_MAX_FILE_BYTES)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                start_new_session=True,  # a terminal's Ctrl-C goes to the trainer, which ends them
                bufsize=0,  # unbuffered: closing a copy (in a forked child) can never flush half a frame
            )
        except OSError as exc:
            raise RuntimeError(f"cannot start the SQL worker process ({exc}). Fix: the SQL envs run queries in a "
                               "child process of the same Python; check the process limit (ulimit -u) and "
                               "memory") from exc
        if self._read(time.monotonic() + _START_TIMEOUT_S, 0) != b"":
            code = self.kill()
            raise RuntimeError(f"the SQL worker process did not start (exit code {code}). Fix: run "
                               f"`{_interpreter()} -I -S {_WORKER_SCRIPT} 1073741824 1073741824` to see its error")

    def call(self, frame: bytes, deadline: float, max_reply: int) -> bytes | None:
        """Send a request, return the reply body; None when the worker died or missed ``deadline``
        (it is killed then)."""
        view = memoryview(frame)
        try:
            while view:
                view = view[os.write(self.proc.stdin.fileno(), view):]
        except OSError:
            return None
        return self._read(deadline, max_reply)

    def _read(self, deadline: float, max_reply: int) -> bytes | None:
        header = self._read_exact(sql_worker.HEADER.size, deadline)
        if header is None:
            return None
        size = sql_worker.HEADER.unpack(header)[0]
        if size > max_reply:  # the worker charges every row; a bigger frame means it misbehaves
            return None
        return self._read_exact(size, deadline)

    def _read_exact(self, size: int, deadline: float) -> bytes | None:
        stdout = self.proc.stdout
        chunks, received = [], 0
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            while received < size:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    return None
                chunk = os.read(stdout.fileno(), min(size - received, MiB))
                if not chunk:  # EOF: the process died
                    return None
                chunks.append(chunk)
                received += len(chunk)
        return b"".join(chunks)

    def kill(self) -> int | None:
        try:
            self.proc.kill()
        except OSError:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel; the OS reaps it later
            return None


class _Pool:
    """Idle workers of one memory limit; a thread takes one per statement and returns it."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def run(self, request: Request, limits: SQLLimits) -> Reply:
        worker = self._take()
        if worker is None:
            worker = _Worker(self.memory_bytes)
        frame = sql_worker.encode(request)
        deadline = time.monotonic() + limits.timeout_s + KILL_GRACE_S
        body = worker.call(frame, deadline, 2 * limits.max_result_bytes + 16 * MiB + 4 * len(request.sql))
        reply = _decode(body) if body is not None else None
        if reply is None:
            timed_out = time.monotonic() >= deadline
            code = worker.kill()
            if timed_out:
                return _failure(TIMEOUT, f"query timed out after {limits.timeout_s:g} s")
            return _failure(CRASHED, f"the SQL worker process died (exit code {code}) running this statement")
        with self._lock:
            if len(self._idle) < _MAX_IDLE_WORKERS:
                self._idle.append(worker)
                worker = None
        if worker is not None:
            worker.kill()
        return reply

    def _take(self) -> _Worker | None:
        """An idle worker that is still alive (one may have been killed from outside), or None."""
        while True:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or worker.proc.poll() is None:
                return worker
            worker.kill()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def forget(self) -> None:
        """In a forked child: the workers belong to the parent; close our copies of the pipes only
        (unbuffered, so nothing is flushed into the parent's conversation)."""
        for worker in self._idle:
            for stream in (worker.proc.stdin, worker.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        self._idle = []
        self._lock = threading.Lock()


def _decode(body: bytes) -> Reply | None:
    try:
        return Reply(*sql_worker.decode(body))
    except (pickle.UnpicklingError, TypeError, ValueError, EOFError, IndexError, AttributeError, MemoryError):
        return None


def _failure(failure: str, message: str) -> Reply:
    return Reply((), None, 0, False, b"", b"", failure, message, "")


_pools: dict[int, _Pool] = {}
_pools_lock = threading.Lock()


def _pool(memory_bytes: int) -> _Pool:
    with _pools_lock:
        pool = _pools.get(memory_bytes)
        if pool is None:
            pool = _pools[memory_bytes] = _Pool(memory_bytes)
        return pool


def _close_pools() -> None:
    with _pools_lock:
        pools = list(_pools.values())
    for pool in pools:
        pool.close()


def _forget_pools() -> None:
    global _pools_lock
    _pools_lock = threading.Lock()
    for pool in _pools.values():
        pool.forget()
    _pools.clear()


atexit.register(_close_pools)
os.register_at_fork(after_in_child=_forget_pools)


def _interpreter() -> str:
    executable = sys.executable or shutil.which("python3")
    if not executable:
        raise RuntimeError("no Python interpreter found to run the SQL worker (sys.executable is empty). "
                           "Fix: run Ridgeline with a normal python executable")
    return executable


# ---------------------------------------------------------------------------------------------
# Result comparison


def same_result(pred: QueryResult, gold: QueryResult, *, order_matters: bool = False) -> bool:
    """Whether two statements gave the same answer, over all their rows (the digests), not only
    the kept ones. Compared as multisets of rows (duplicates count) unless ``order_matters``;
    values as :func:`~ridgeline.envs.sql_worker.canonical` makes them (``2`` equals ``2.0``, floats
    to 9 significant digits, ``'1'`` is not ``1``, NULL only NULL); column names are not compared
    but column order and row width are. A failed statement never matches."""
    if not (pred.ok and gold.ok and pred.ordered and gold.ordered) or pred.row_count != gold.row_count:
        return False  # failed, or not digested (run_query(digest=False)): no answer to compare
    if order_matters:
        return pred.ordered == gold.ordered
    return pred.unordered == gold.unordered


def results_match(
    pred_rows: Sequence[Sequence[Any]] | None,
    gold_rows: Sequence[Sequence[Any]] | None,
    order_matters: bool = False,
) -> bool:
    """:func:`same_result` for two lists of rows (``None``, a failed query, never matches)."""
    if pred_rows is None or gold_rows is None:
        return False
    return same_result(_digested(pred_rows), _digested(gold_rows), order_matters=order_matters)


def _digested(rows: Sequence[Sequence[Any]]) -> QueryResult:
    digest = RowDigest()
    for row in rows:
        digest.add(tuple(row))
    ordered, unordered = digest.values()
    return QueryResult(rows=None, row_count=len(rows), complete=True, ordered=ordered, unordered=unordered)


def has_top_level_order_by(sql: str) -> bool:
    """Whether the outermost query of ``sql`` has ORDER BY (so row order is part of the answer).

    String literals, quoted identifiers and comments are skipped, and an ORDER BY inside
    parentheses (a subquery, a window ``OVER (ORDER BY ...)``) does not count.
    """
    depth = 0
    previous = ""
    for token in _tokens_outside_literals(sql):
        if token in "()":
            depth = depth + 1 if token == "(" else max(0, depth - 1)
            previous = ""
            continue
        word = token.lower()
        if depth == 0 and previous == "order" and word == "by":
            return True
        previous = word
    return False


_TOKEN = re.compile(
    r"""'(?:[^']|'')*'?|"(?:[^"]|"")*"?|`[^`]*`?|\[[^\]]*\]?|--[^\n]*|/\*.*?(?:\*/|\Z)|[()]|[A-Za-z_][A-Za-z_0-9]*|\S""",
    re.DOTALL,
)


def _tokens_outside_literals(sql: str) -> list[str]:
    tokens = []
    for token in _TOKEN.findall(sql):
        if token[0] in "'\"`[" or token.startswith("--") or token.startswith("/*"):
            continue
        tokens.append(token)
    return tokens
