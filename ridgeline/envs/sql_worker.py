"""The process that runs model-written SQL for :mod:`ridgeline.envs.sql_executor`.

Why a process: SQLite checks for interrupts between VM instructions, not inside one function
call, so ``printf('%.*c', 2000000000, 'x')`` or ``instr()`` over two long strings runs for
seconds to minutes whatever the time limit, and the trainer cannot stop a thread. The executor
kills this process instead, and its memory and file-size limits (RLIMIT_AS, RLIMIT_FSIZE) bound
what any statement can allocate, in a process whose loss costs nothing.

Inside, each statement gets a fresh connection with:

* SQLite's own limits: no value (string, blob, row record) longer than ``max_value_bytes``
  (``SQLITE_LIMIT_LENGTH``: giant ``zeroblob``/``randomblob``/``group_concat``/``replace``
  results fail with "string or blob too big", a giant ``printf`` gives NULL), no attached
  databases;
* a progress handler that aborts the statement at the deadline (the usual case; the kill is for
  single long calls);
* rows read one at a time: each row's Python size is added to the budget (``max_result_bytes``)
  before it is kept, and the deadline is checked per row too. A preview (``Request.preview``: an
  exploratory query whose rows only make an observation) cuts each text and blob to
  ``cell_chars`` first, and stops reading at the budget instead of failing (``complete`` false);
* an authorizer (see :func:`_authorizer`). ``READ_ONLY`` mode (``text2sql_lenient``) also opens
  the file read-only with ``PRAGMA query_only`` and only lets a SELECT/WITH/VALUES/PRAGMA
  statement reach the compiler. ``ROLLED_BACK`` mode (skyrl-gym's ``text2sql``) runs any
  statement inside a transaction that is always rolled back, as skyrl-gym does, with the
  rollback journal in memory and cache spilling off, so the database file is never written
  (killing the process mid-write cannot leave a half-written file or a hot journal), and the file
  may grow by at most ``_MAX_GROWTH_BYTES`` inside the transaction.

Standard library only and no imports from ``ridgeline``: the executor runs this file as a
script (``python -I -S sql_worker.py MEMORY_BYTES FILE_BYTES``) and also imports it for
:func:`row_hash` and the wire format. Wire: frames of an 8-byte little-endian length and a pickle
of a plain tuple (``Request``/``Reply`` fields in order; nothing that needs a class to unpickle).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import signal
import sqlite3
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READ_ONLY = "read_only"
ROLLED_BACK = "rolled_back"

# Failure reasons (Reply.failure); "crashed" is set by the executor when the process dies.
SQL_ERROR = "sql_error"   # SQLite rejected or failed the statement
REFUSED = "refused"       # not allowed here (a write, ATTACH, a non-query statement, ...)
TIMEOUT = "timeout"
TOO_LARGE = "too_large"   # a value, the kept result or the process's memory hit its limit
CRASHED = "crashed"
UNOPENABLE = "unopenable"  # SQLite cannot open the file at all (permissions): not the SQL's fault

HEADER = struct.Struct("<Q")

# Statement kinds a READ_ONLY query may start with; anything else is refused before SQLite parses it.
_ALLOWED_FIRST_WORDS = frozenset({"select", "with", "values", "pragma"})

# Pragmas that only describe the schema; their argument is a table or index name, so they cannot
# change anything whatever it is. In READ_ONLY mode every other pragma is denied (some
# no-argument pragmas such as optimize or wal_checkpoint do write).
_INTROSPECTION_PRAGMAS = frozenset(
    {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo", "foreign_key_list"}
)
# In ROLLED_BACK mode a statement may change only its own connection (closed right after) and
# the rolled-back transaction; these pragmas reach past both: process-wide settings that would
# change later statements in this process, the journal mode (leaving the in-memory journal) and
# checkpoints (which write the database file).
_GLOBAL_PRAGMAS = frozenset({"temp_store_directory", "data_store_directory", "soft_heap_limit",
                             "hard_heap_limit", "journal_mode", "wal_checkpoint", "wal_autocheckpoint"})
# load_extension runs native code; fts3_tokenizer (enabled in Debian's SQLite build) reads and
# registers raw function pointers, a known route to code execution.
_DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer"})

# SQLITE_RECURSIVE (33) is missing from some Python builds' constant list.
_SQLITE_RECURSIVE = getattr(sqlite3, "SQLITE_RECURSIVE", 33)
_READ_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, _SQLITE_RECURSIVE})

# Authorizer action codes -> readable names for error messages. Listed explicitly because other
# sqlite3 constants (limits, error codes) reuse the same small integers.
_ACTION_NAMES = dict(enumerate(
    "CREATE_INDEX CREATE_TABLE CREATE_TEMP_INDEX CREATE_TEMP_TABLE CREATE_TEMP_TRIGGER "
    "CREATE_TEMP_VIEW CREATE_TRIGGER CREATE_VIEW DELETE DROP_INDEX DROP_TABLE DROP_TEMP_INDEX "
    "DROP_TEMP_TABLE DROP_TEMP_TRIGGER DROP_TEMP_VIEW DROP_TRIGGER DROP_VIEW INSERT PRAGMA READ "
    "SELECT TRANSACTION UPDATE ATTACH DETACH ALTER_TABLE REINDEX ANALYZE CREATE_VTABLE DROP_VTABLE "
    "FUNCTION SAVEPOINT RECURSIVE".split(),
    start=1,
))

_PROGRESS_EVERY_OPS = 1000  # VM instructions between deadline checks: microseconds, cheap
_MAX_GROWTH_BYTES = 64 * 1024 * 1024  # ROLLED_BACK: how much a write may grow the file (in memory)
_PARENT_CHECK_S = 1.0

# Scanners for the statement text (model text), each matched once at one position: linear
# time. The possessive outer loop never backtracks into an earlier comment; an unclosed block
# comment runs to the end, as in SQLite.
_LEADING_NOISE = re.compile(r"(?:\s+|--[^\n]*+\n?|/\*(?s:.*?)(?:\*/|\Z))*+")
_FIRST_WORD = re.compile(r"[A-Za-z_]+")
_TERMINATORS = re.compile(r"[\s;]*")


@dataclass(frozen=True)
class Request:
    """One statement to run. keep_rows: rows to send back (None: all); digest: read every row and
    hash it (else reading stops at the first row past ``keep_rows``)."""

    mode: str
    db_path: str          # absolute path of an existing file
    sql: str
    timeout_s: float
    keep_rows: int | None
    max_value_bytes: int
    max_result_bytes: int
    digest: bool
    preview: bool = False          # past the budget: stop reading (not a failure)
    cell_chars: int | None = None  # a preview's texts and blobs cut to this length


@dataclass(frozen=True)
class Reply:
    """What a statement gave. rows: the kept rows (None when it failed); row_count: the rows
    read; complete: that was all of them (else there were more than ``keep_rows``);
    ordered/unordered: digests of all rows (see :class:`RowDigest`; empty unless asked);
    failure: one of the reasons above, with ``error`` the message and ``error_type`` the
    exception class for SQLite's own errors ("" for the worker's refusals and limits)."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]] | None
    row_count: int
    complete: bool
    ordered: bytes
    unordered: bytes
    failure: str | None
    error: str | None
    error_type: str


# ---------------------------------------------------------------------------------------------
# Canonical row digests (also imported by the executor for results_match).

_MODULUS = 1 << 256
_ZERO = 1e-9  # floats smaller than this are float noise around 0


def canonical(value: Any) -> Any:
    """The value compared: an integral float is its int (``2.0`` equals ``2``), a float under
    1e-9 in size is 0, other floats are rounded to 9 significant digits (float noise of another
    summation order does not count); ints, text, blobs and NULL stay as they are, so ``'1'``
    never equals ``1``."""
    if isinstance(value, float):
        if abs(value) < _ZERO:
            return 0
        if value.is_integer():
            return int(value)
        rounded = float(f"{value:.9g}")
        return int(rounded) if rounded.is_integer() else rounded
    return value


def row_hash(row: tuple[Any, ...]) -> bytes:
    """32-byte hash of a row's canonical values (``repr`` keeps types apart: ``'1'`` vs ``1``)."""
    text = repr(tuple(map(canonical, row)))
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=32).digest()


class RowDigest:
    """Streaming digests of a result: ``ordered`` hashes the row hashes in order; ``unordered``
    is their sum mod 2**256, the same for any order and different when a row's count differs."""

    def __init__(self) -> None:
        self._ordered = hashlib.blake2b(digest_size=32)
        self._sum = 0

    def add(self, row: tuple[Any, ...]) -> None:
        digest = row_hash(row)
        self._ordered.update(digest)
        self._sum = (self._sum + int.from_bytes(digest, "little")) % _MODULUS

    def values(self) -> tuple[bytes, bytes]:
        return self._ordered.digest(), self._sum.to_bytes(32, "little")


# ---------------------------------------------------------------------------------------------
# Statement text checks (READ_ONLY)


def strip_terminators(sql: str) -> str:
    """``SELECT 1; ;`` -> ``SELECT 1``: models often end with extra semicolons, which sqlite3
    would otherwise count as a second statement. Scans the reversed text once (a ``[\\s;]+\\Z``
    search would retry from every position of a long run of spaces)."""
    trailing = _TERMINATORS.match(sql[::-1]).end()
    return sql[: len(sql) - trailing]


def statement_refusal(statement: str) -> str | None:
    """Refusal message unless the statement starts (after spaces and comments) with an allowed
    keyword."""
    body = statement[_LEADING_NOISE.match(statement).end():]
    if not body.strip():
        return "empty query"
    word = _FIRST_WORD.match(body)
    first = word.group(0).lower() if word else body[:1]
    if first not in _ALLOWED_FIRST_WORDS:
        return f"not allowed: {first.upper()} statement (the database is read-only; only SELECT/WITH queries may run)"
    return None


# ---------------------------------------------------------------------------------------------
# Running one statement


class _Stop(Exception):
    """Ends the row loop with a failure reason and message."""

    def __init__(self, failure: str, message: str) -> None:
        super().__init__(message)
        self.failure = failure


def _authorizer(mode: str, denials: list[str]):
    """READ_ONLY: allow reads, function calls (but :data:`_DENIED_FUNCTIONS`), recursive CTEs and
    the introspection pragmas; deny everything else at compile time, ATTACH included (VACUUM
    INTO goes through it: it can *create* a file even on a read-only connection). ROLLED_BACK:
    allow everything but ATTACH/DETACH (ATTACH creates files, even inside a transaction), the
    denied functions and :data:`_GLOBAL_PRAGMAS`. Denials are recorded for the message."""

    def deny(action: int, detail: str) -> int:
        denials.append(f"{_ACTION_NAMES.get(action, f'action {action}')} {detail}".strip())
        return sqlite3.SQLITE_DENY

    def authorize(action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
        name = (arg1 or "").lower()
        if action == sqlite3.SQLITE_FUNCTION:
            function = (arg2 or "").lower()
            return deny(action, f"{function}()") if function in _DENIED_FUNCTIONS else sqlite3.SQLITE_OK
        if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
            return deny(action, arg1 or "")
        if action == sqlite3.SQLITE_PRAGMA:
            allowed = name in _INTROSPECTION_PRAGMAS if mode == READ_ONLY else name not in _GLOBAL_PRAGMAS
            return sqlite3.SQLITE_OK if allowed else deny(action, " ".join(a for a in (arg1, arg2) if a))
        if mode == ROLLED_BACK or action in _READ_ACTIONS:
            return sqlite3.SQLITE_OK
        return deny(action, " ".join(a for a in (arg1, arg2) if a))

    return authorize


def _open(request: Request) -> sqlite3.Connection:
    # as_uri() percent-encodes the path, so names with '?', '#' or spaces cannot inject URI
    # options; mode=rw (not rwc) never creates a missing file.
    uri = Path(request.db_path).as_uri() + ("?mode=ro" if request.mode == READ_ONLY else "?mode=rw")
    return sqlite3.connect(uri, uri=True, check_same_thread=False)


def _configure(conn: sqlite3.Connection, request: Request) -> None:
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, request.max_value_bytes)
    if request.mode == READ_ONLY:
        # Invalid UTF-8 stored in a TEXT column would otherwise fail the fetch.
        conn.text_factory = lambda data: data.decode("utf-8", "replace")
        conn.execute("PRAGMA query_only=ON")  # before the authorizer, which would deny this pragma
        return
    # ROLLED_BACK: reading the schema first makes SQLite read the header, so journal_mode
    # reports WAL for a WAL database (leaving WAL would rewrite the files; WAL writes reach the
    # -wal file only on commit, which never happens, so it is left as it is).
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    if str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
        conn.execute("PRAGMA journal_mode=MEMORY")
    conn.execute("PRAGMA cache_spill=OFF")  # dirty pages stay in memory: the file is never written
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count={pages + _MAX_GROWTH_BYTES // page_size}")


def execute(request: Request) -> Reply:
    """Run ``request.sql`` as described in the module docstring; never raises for the SQL."""
    deadline = time.monotonic() + request.timeout_s
    sql = request.sql
    if request.mode == READ_ONLY:
        sql = strip_terminators(sql)
        refusal = statement_refusal(sql)
        if refusal is not None:
            return _failed(REFUSED, refusal)
    try:
        conn = _open(request)
    except sqlite3.Error as exc:
        return _failed(UNOPENABLE, str(exc), type(exc).__name__)
    denials: list[str] = []
    timed_out = [False]

    def on_progress() -> int:
        # A non-zero return makes SQLite abort the running statement with "interrupted".
        if time.monotonic() > deadline:
            timed_out[0] = True
            return 1
        return 0

    try:
        _configure(conn, request)
        conn.set_authorizer(_authorizer(request.mode, denials))
        conn.set_progress_handler(on_progress, _PROGRESS_EVERY_OPS)
        if request.mode == ROLLED_BACK:
            conn.execute("BEGIN TRANSACTION;")
        cursor = conn.cursor()
        cursor.execute(sql)
        columns = tuple(d[0] for d in cursor.description) if cursor.description else ()
        rows, row_count, complete, digests = _read_rows(cursor, request, deadline)
    except _Stop as stop:
        return _failed(stop.failure, str(stop))
    except MemoryError:
        return _failed(TOO_LARGE, "out of memory (the SQL worker's memory limit)")
    except Exception as exc:  # noqa: BLE001 - any failure caused by the SQL text is a result
        if timed_out[0]:
            return _failed(TIMEOUT, f"query timed out after {request.timeout_s:g} s")
        if denials:
            where = "the database is read-only; only queries may run" if request.mode == READ_ONLY else \
                "it would reach outside this query's rolled-back transaction"
            return _failed(REFUSED, f"not allowed: {denials[0]} ({where})")
        failure = TOO_LARGE if isinstance(exc, sqlite3.DataError) and "too big" in str(exc) else SQL_ERROR
        return _failed(failure, str(exc), type(exc).__name__)
    finally:
        for end in (conn.rollback, conn.close):
            try:
                end()
            except Exception:  # noqa: BLE001 - an interrupted connection may refuse; it is closed anyway
                pass
    return Reply(columns, rows, row_count, complete, *digests, None, None, "")


def _read_rows(cursor: sqlite3.Cursor, request: Request, deadline: float):
    """Rows one at a time: each kept row's size is charged to the budget before it is kept, so
    memory never holds more than the budget plus one row; with ``digest``, every row goes into
    the digests, else reading stops at the first row past ``keep_rows``."""
    keep = request.keep_rows
    budget = request.max_result_bytes
    digest = RowDigest() if request.digest else None
    rows: list[tuple[Any, ...]] = []
    count = 0
    for row in cursor:
        if time.monotonic() > deadline:
            raise _Stop(TIMEOUT, f"query timed out after {request.timeout_s:g} s")
        count += 1
        if digest is not None:
            digest.add(row)
        if keep is None or len(rows) < keep:
            if request.cell_chars is not None:
                row = tuple(_cut(v, request.cell_chars) for v in row)
            budget -= sys.getsizeof(row) + sum(map(sys.getsizeof, row))
            if budget < 0 and request.preview:
                return rows, count, False, (b"", b"")
            if budget < 0:
                raise _Stop(TOO_LARGE, f"result too large (over {request.max_result_bytes // (1024 * 1024)} MiB "
                                       "in memory; the limit is max_result_bytes)")
            rows.append(row)
        elif digest is None:
            return rows, count, False, (b"", b"")
    return rows, count, True, digest.values() if digest is not None else (b"", b"")


def _cut(value: Any, chars: int) -> Any:
    """A text or blob cut to ``chars`` (marked with "..."); other values as they are."""
    if isinstance(value, (str, bytes)) and len(value) > chars:
        return value[:chars] + ("..." if isinstance(value, str) else b"...")
    return value


def _failed(failure: str, message: str, error_type: str = "") -> Reply:
    return Reply((), None, 0, False, b"", b"", failure, message, error_type)


# ---------------------------------------------------------------------------------------------
# Wire format and the process's main loop


class _PlainUnpickler(pickle.Unpickler):
    """Loads only builtin containers and scalars: a frame cannot name a class or function."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from an SQL worker frame")


def encode(message: Request | Reply) -> bytes:
    body = pickle.dumps(astuple_shallow(message), protocol=5)
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> tuple[Any, ...]:
    value = _PlainUnpickler(io.BytesIO(body)).load()
    if not isinstance(value, tuple):
        raise pickle.UnpicklingError(f"expected a tuple, got {type(value).__name__}")
    return value


def astuple_shallow(message: Request | Reply) -> tuple[Any, ...]:
    # dataclasses.astuple would deep-copy every row
    return tuple(getattr(message, name) for name in message.__dataclass_fields__)


def _read_exact(stream, size: int) -> bytes | None:
    data = stream.read(size)
    return data if data is not None and len(data) == size else None


def _watch_parent(parent: int) -> None:
    # stdin reaches EOF when the parent dies, but only once a running statement ends; this ends a
    # long single call too.
    while True:
        time.sleep(_PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(0)


def _set_limits(memory_bytes: int, file_bytes: int) -> None:
    import resource

    for which, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_FSIZE, file_bytes),
                         (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass  # not supported here (e.g. RLIMIT_AS on macOS): the other bounds still hold
    # Past RLIMIT_FSIZE a write fails with EFBIG (SQLite: "database or disk is full") instead of
    # the signal killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def main(argv: list[str]) -> int:
    memory_bytes, file_bytes = int(argv[1]), int(argv[2])
    _set_limits(memory_bytes, file_bytes)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(HEADER.pack(0))  # ready
    stdout.flush()
    while True:
        header = _read_exact(stdin, HEADER.size)
        if header is None:
            return 0
        body = _read_exact(stdin, HEADER.unpack(header)[0])
        if body is None:
            return 0
        reply = execute(Request(*decode(body)))
        try:
            frame = encode(reply)
        except MemoryError:
            frame = encode(_failed(TOO_LARGE, "out of memory sending the result (the SQL worker's memory limit)"))
        stdout.write(frame)
        stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
