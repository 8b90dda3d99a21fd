"""Hostile SQL and hostile responses against the SQL envs (issue 19): statements that try to
exhaust memory or time (inside one function call too), oversized values, endless rows, wrong
answers that share the kept rows with the right one, writes, ATTACH, pragmas, extensions; and
responses built to make the parsers quadratic. Each must end within its bound, cost this process
no memory, leave the database file as it was, and score 0 with a counted reason."""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import HANG_GUARD_S

from ridgeline.envs import make
from ridgeline.envs import sql_executor
from ridgeline.envs.sql_executor import SQLLimits, run_in_rollback, run_query
from ridgeline.envs.text2sql import first_sql_block, verified_solution
from ridgeline.envs.text2sql_lenient import extract_tag

ROOT = Path(__file__).resolve().parents[1]
# The time limit under test: a statement that runs for ever must end with failure "timeout", which
# the executor reports only once this limit (plus its KILL_GRACE_S) has passed.
TIMEOUT = 0.5
LIMITS = SQLLimits(timeout_s=TIMEOUT)
# Every other statement gets a time limit it never reaches: a memory or size bound is the one under
# test, and on a busy machine building 8 MB values takes seconds (with 5 s and 20 s limits the
# memory bombs ended as "timeout" instead of "too_large" under load). A hang guard only.
UNTIMED = SQLLimits(timeout_s=HANG_GUARD_S)


def numbers(last: int | None = None) -> str:
    """A recursive CTE of 1..last (endless when None)."""
    stop = "" if last is None else f" WHERE n < {last}"
    return f"WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r{stop})"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    path = tmp_path / "toy.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT)")
        conn.executemany("INSERT INTO t VALUES (?, ?)", [(i, f"name{i}") for i in range(1, 2001)])
    conn.close()
    return path


# --- the statements ------------------------------------------------------------------------------

HALF = 4 * 1024 * 1024 - 16  # half of the default 8 MiB value limit
# Each: (name, SQL, the failure it must end in). The old executor (fetchmany chunks, a progress
# handler as the only clock) let the first two allocate ~2 GB and the "one call" ones run for
# seconds to minutes past the limit.
BOMBS = [
    ("blob rows", f"{numbers(300)} SELECT zeroblob(8000000) FROM r", "too_large"),
    ("random rows", f"{numbers(300)} SELECT randomblob(8000000), n FROM r", "too_large"),
    ("wide row", "SELECT " + ", ".join(["zeroblob(8000000)"] * 300), "too_large"),
    ("giant value", "SELECT zeroblob(1000000000)", "too_large"),
    ("giant group_concat", f"{numbers(20000)} SELECT group_concat(printf('%.*c', 1000, 'x')) FROM r", "too_large"),
    # SQLite's printf gives NULL past the value limit: bounded, not an error
    ("giant printf width", "SELECT printf('%900000000d', 1)", None),
    ("endless CTE", f"{numbers()} SELECT count(*) FROM r", "timeout"),
    ("cross join", f"{numbers(100000)} SELECT count(*) FROM r AS a, r AS b", "timeout"),
    ("endless rows", f"{numbers()} SELECT n FROM r", "timeout"),
    # one function call each: SQLite checks neither its progress handler nor interrupts inside
    ("one call: printf precision", "SELECT length(printf('%.*c', 2000000000, 'x'))", "timeout"),
    ("one call: instr", f"SELECT instr(printf('%.*c', {2 * HALF}, 'a'), printf('%.*c', {HALF}, 'a') || 'b')",
     "timeout"),
    ("one call: replace", f"SELECT length(replace(printf('%.*c', {2 * HALF}, 'a'), printf('%.*c', {HALF}, 'a') || 'b', "
     "'x'))", "timeout"),
]
# LIKE/GLOB with thousands of wildcards over a long string: this SQLite bails out early, but they
# must stay bounded on any build.
WILDCARDS = [
    f"SELECT printf('%.*c', {2 * HALF}, 'a') LIKE (replace(printf('%.*c', 20000, 'x'), 'x', '%a') || 'b')",
    f"SELECT printf('%.*c', {2 * HALF}, 'a') GLOB (replace(printf('%.*c', 20000, 'x'), 'x', '*a') || 'b')",
]


@pytest.mark.parametrize("name, sql, failure", BOMBS, ids=[b[0] for b in BOMBS])
def test_bombs_end_with_their_reason(db, name, sql, failure):
    # time bombs the short clock under test; memory bombs no clock they could reach first
    limits = LIMITS if failure == "timeout" else UNTIMED
    before = digest(db)
    for run in (lambda: run_query(db, sql, limits=limits), lambda: run_in_rollback(db, sql, limits)):
        result = run()
        assert result.failure == failure, (name, result)
        assert result.rows == [(None,)] if failure is None else result.rows is None, (name, result)
    assert digest(db) == before
    assert run_query(db, "SELECT count(*) FROM t").rows == [(2000,)]  # the next statement is served


@pytest.mark.parametrize("sql", WILDCARDS)
def test_wildcard_patterns_are_bounded(db, sql):
    result = run_query(db, sql, limits=LIMITS)
    assert result.rows == [(0,)] or result.failure == "timeout"


def test_value_limit_is_the_setting(db):
    small = SQLLimits(timeout_s=HANG_GUARD_S, max_value_bytes=1024)
    assert run_query(db, "SELECT zeroblob(1024)", limits=small).ok
    result = run_query(db, "SELECT zeroblob(1025)", limits=small)
    assert result.failure == "too_large" and "too big" in result.error
    # reading a stored value over the limit fails too, not only building one
    assert run_query(db, "SELECT group_concat(name) FROM t", limits=small).failure == "too_large"


def test_result_limit_is_checked_per_row(db):
    limits = SQLLimits(timeout_s=HANG_GUARD_S, max_result_bytes=1024 * 1024)
    one_row = 1024 * 1024 // 4  # four of these rows fit in the budget, not five
    fits = run_query(db, f"{numbers(3)} SELECT zeroblob({one_row - 200}) FROM r", limits=limits)
    assert fits.ok and fits.row_count == 3
    result = run_query(db, f"{numbers(5)} SELECT zeroblob({one_row}) FROM r", limits=limits)
    assert result.failure == "too_large" and "max_result_bytes" in result.error
    # only kept rows count: with max_rows=2 the same rows are read and digested, not kept
    assert run_query(db, f"{numbers(5)} SELECT zeroblob({one_row}) FROM r", max_rows=2, limits=limits).ok


MEMORY_SCRIPT = """
import json, resource, sys
from ridgeline.envs.sql_executor import SQLLimits, run_in_rollback, run_query
db, sqls, untimed = sys.argv[1], json.loads(sys.argv[2]), SQLLimits(timeout_s=float(sys.argv[3]))
run_query(db, "SELECT 1", limits=untimed)  # the worker, imports and caches exist before the baseline
run_in_rollback(db, "SELECT 1", untimed)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
failures = [run_query(db, sql, limits=untimed).failure for sql in sqls]
failures += [run_in_rollback(db, sql, untimed).failure for sql in sqls]
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grown_kib": grown, "failures": failures}))
"""


def test_memory_bombs_do_not_grow_this_process(db):
    """Peak RSS of a fresh process running every memory bomb both ways. The old executor grew
    by ~2 GB on the first one (256 rows of 8 MB fetched before the byte count was checked)."""
    import json

    bombs = [(sql, failure) for name, sql, failure in BOMBS if failure != "timeout"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(db), json.dumps([sql for sql, _ in bombs]),
                          str(HANG_GUARD_S)], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["failures"] == [failure for _, failure in bombs] * 2
    assert report["grown_kib"] < 64 * 1024, report  # MiB-scale noise, not a result


def test_worker_memory_is_capped(db):
    """The worker's RLIMIT_AS stops SQLite itself: one row of 300 random 8 MB values is built in
    SQLite's memory (2.4 GB) before any row reaches Python. The next statement is served."""
    limits = UNTIMED
    assert sql_executor.worker_memory_bytes(limits) < 1024 * 1024 * 1024
    for run in (lambda sql: run_query(db, sql, limits=limits), lambda sql: run_in_rollback(db, sql, limits)):
        result = run("SELECT " + ", ".join(["randomblob(8000000)"] * 300))
        assert result.failure == "too_large" and "out of memory" in result.error, result
        assert run("SELECT 1").rows == [(1,)]


# --- answers are compared in full ---------------------------------------------------------------


def env_for(db: Path, gold: str, **settings):
    extras = {"reward_spec": {"method": "rule", "ground_truth": gold}, "extra_info": {"db_id": db.stem}}
    return make("text2sql_lenient", extras=extras, db_root=str(db.parent), **settings)


@pytest.mark.parametrize("answer", [
    "SELECT id FROM t WHERE id <= 1501",                           # one row more
    "SELECT id FROM t WHERE id <= 1499",                           # one row fewer
    "SELECT CASE WHEN id = 1500 THEN -1 ELSE id END FROM t WHERE id <= 1500",  # the last row differs
    "SELECT id FROM t WHERE id <= 1500 UNION ALL SELECT 1",        # a duplicate
])
def test_wrong_answers_that_share_the_kept_rows_score_zero(db, answer):
    """The old env compared the first max_rows rows only: each of these scored 1.0."""
    gold = "SELECT id FROM t WHERE id <= 1500"
    assert env_for(db, gold, max_rows=1000).step(f"<solution>{answer}</solution>").reward == 0.0
    assert env_for(db, gold, max_rows=1000).step(f"<solution>{gold} ORDER BY id DESC</solution>").reward == 1.0
    assert env_for(db, gold + " ORDER BY id", max_rows=10).step(
        f"<solution>{gold} ORDER BY id DESC</solution>").reward == 0.0


def test_digests_cover_every_row_and_count_duplicates(db):
    full = run_query(db, "SELECT id, name FROM t", max_rows=5)
    shuffled = run_query(db, "SELECT id, name FROM t ORDER BY random()", max_rows=5)
    assert full.complete and full.row_count == 2000 and full.truncated and len(full.rows) == 5
    assert sql_executor.same_result(full, shuffled) and not sql_executor.same_result(full, shuffled, order_matters=True)
    doubled = run_query(db, "SELECT id, name FROM t UNION ALL SELECT 1, 'name1' EXCEPT SELECT 2, 'name2'")
    assert not sql_executor.same_result(full, doubled)
    peek = run_query(db, "SELECT id, name FROM t", max_rows=5, digest=False)
    assert not peek.complete and peek.row_count == 6 and not sql_executor.same_result(peek, peek)


# --- the database cannot be changed or escaped ---------------------------------------------------

ROLLED_BACK_REFUSED = [
    "ATTACH DATABASE '{p}' AS other",
    "ATTACH 'file:{p}?mode=rwc' AS other",
    "VACUUM INTO '{p}'",
    "SELECT load_extension('{p}')",
    "SELECT fts3_tokenizer('simple')",  # leaks a function pointer; the two-argument form sets one
    "PRAGMA temp_store_directory = '{d}'",
    "PRAGMA hard_heap_limit = 1000",
    "PRAGMA soft_heap_limit = 1000",
    "PRAGMA journal_mode = DELETE",
    "PRAGMA wal_checkpoint",
]


@pytest.mark.parametrize("template", ROLLED_BACK_REFUSED)
def test_text2sql_refuses_what_reaches_past_the_transaction(db, tmp_path, template):
    """skyrl-gym's executor runs ATTACH inside its transaction (creating the file) and every
    pragma; here they are refused, and no file appears."""
    target = tmp_path / "created.sqlite"
    before, files = digest(db), sorted(os.listdir(tmp_path))
    result = run_in_rollback(db, template.format(p=target, d=tmp_path), LIMITS)
    assert result.failure in ("refused", "sql_error") and not result.ok, result
    assert not target.exists() and sorted(os.listdir(tmp_path)) == files and digest(db) == before
    assert run_in_rollback(db, "SELECT count(*) FROM t", LIMITS).rows == [(2000,)]


@pytest.mark.parametrize("sql", [
    "SELECT load_extension('/nonexistent/lib')", "SELECT fts3_tokenizer('simple')",
    "PRAGMA hard_heap_limit = 1000", "PRAGMA temp_store_directory = '/tmp'", "PRAGMA query_only = OFF",
    "WITH RECURSIVE r(n) AS (SELECT 1) DELETE FROM t",
])
def test_read_only_refuses_extensions_pragmas_and_writes(db, sql):
    before = digest(db)
    result = run_query(db, sql, limits=LIMITS)
    assert result.failure == "refused" and "not allowed" in result.error, result
    assert digest(db) == before


def test_text2sql_writes_never_touch_the_file(db):
    """A write runs (skyrl-gym's semantics) but its pages stay in memory: no journal file, the
    bytes unchanged, and a growth past 64 MiB is refused by SQLite."""
    before, files = digest(db), sorted(os.listdir(db.parent))
    for sql in ["DELETE FROM t", "UPDATE t SET name = 'x'", "CREATE TABLE u AS SELECT * FROM t",
                "DROP TABLE t", "INSERT INTO t (name) SELECT name FROM t"]:
        result = run_in_rollback(db, sql, LIMITS)
        assert result.ok and result.rows == [], (sql, result)
        assert digest(db) == before and sorted(os.listdir(db.parent)) == files
    grow = run_in_rollback(db, f"CREATE TABLE big AS {numbers(100)} SELECT zeroblob(1000000) FROM r", LIMITS)
    assert grow.failure == "sql_error" and "full" in grow.error
    assert digest(db) == before and sorted(os.listdir(db.parent)) == files


def test_killing_a_worker_mid_write_leaves_the_file_intact(db):
    """The worker runs a long write; it is killed from outside (as the time limit does): the
    statement reports the crash, the file is unchanged, and the next statement works."""
    before = digest(db)
    pool = sql_executor._pool(sql_executor.worker_memory_bytes(UNTIMED))
    run_in_rollback(db, "SELECT 1", UNTIMED)  # one idle worker now exists
    [worker] = pool._idle[-1:]
    slow_write = "UPDATE t SET name = (SELECT count(*) FROM t AS a, t AS b WHERE a.id > t.id)"  # minutes
    results = []
    thread = threading.Thread(target=lambda: results.append(run_in_rollback(db, slow_write, UNTIMED)))
    thread.start()
    _wait_until_busy(worker.proc.pid)  # it is inside the write
    os.kill(worker.proc.pid, signal.SIGKILL)
    thread.join(HANG_GUARD_S)
    [result] = results
    assert result.failure == "crashed" and "died" in result.error
    assert digest(db) == before and not any(name.endswith("-journal") for name in os.listdir(db.parent))
    assert run_in_rollback(db, "SELECT count(*) FROM t", LIMITS).rows == [(2000,)]


# one SQLite call that runs for hours (a quadratic instr over 8 MB), with no time limit it could reach
WORKER_ORPHAN_SCRIPT = """
import sys
from ridgeline.envs import sql_executor
from ridgeline.envs.sql_executor import SQLLimits, run_query
limits = SQLLimits(timeout_s=float(sys.argv[3]))
run_query(sys.argv[1], "SELECT 1", limits=limits)
[pool] = sql_executor._pools.values()
print(pool._idle[0].proc.pid, flush=True)
run_query(sys.argv[1], sys.argv[2], limits=limits)
"""


def test_workers_die_with_the_trainer(db):
    """A trainer killed with -9 while its worker is inside one call that would run for hours: the
    worker exits (it watches its parent) instead of finishing the call."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    endless = next(sql for name, sql, _ in BOMBS if name == "one call: instr")
    proc = subprocess.Popen([sys.executable, "-c", WORKER_ORPHAN_SCRIPT, str(db), endless, str(HANG_GUARD_S)], env=env,
                            stdout=subprocess.PIPE, text=True)
    worker_pid = int(proc.stdout.readline())
    _wait_until_busy(worker_pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + HANG_GUARD_S  # a hang guard: the call it is in lasts hours
    while time.monotonic() < deadline and _alive(worker_pid):
        time.sleep(0.1)
    assert not _alive(worker_pid)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _wait_until_busy(pid: int, ticks: int = 20) -> None:
    """Return once worker ``pid`` has spent ``ticks`` clock ticks of CPU since the call (an idle
    worker spends none): it is running the statement it was sent, however slow the machine."""
    start, deadline = _cpu_ticks(pid), time.monotonic() + HANG_GUARD_S
    while _cpu_ticks(pid) - start < ticks:
        assert time.monotonic() < deadline, "the worker never started the statement"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return status.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_forked_child_starts_its_own_workers(db):
    """A child forked while workers exist (a data loader, say) must not talk to the parent's."""
    assert run_query(db, "SELECT 1").rows == [(1,)]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own worker answers
        ok = run_query(db, "SELECT count(*) FROM t").rows == [(2000,)]
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    os.close(read), os.close(write)
    assert run_query(db, "SELECT 2").rows == [(2,)]


def test_concurrent_statements_each_get_a_worker(db):
    """Bombs and normal queries from many threads at once: the normal ones are answered."""
    results: dict[int, object] = {}

    def query(index: int) -> None:
        if index % 2:  # not the bound under test: no clock it could reach on a busy machine
            results[index] = run_query(db, "SELECT count(*) FROM t", limits=UNTIMED)
        else:
            results[index] = run_query(db, "SELECT length(printf('%.*c', 2000000000, 'x'))", limits=LIMITS)

    threads = [threading.Thread(target=query, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert all(results[i].rows == [(2000,)] for i in range(1, 8, 2))
    assert all(results[i].failure == "timeout" for i in range(0, 8, 2))


# --- the envs: bad SQL scores 0 with a counted reason, never raises -------------------------------


def test_lenient_env_counts_each_reason(db):
    env = env_for(db, "SELECT id FROM t", timeout_s=TIMEOUT, max_turns=5)
    env.step("<sql>SELECT zeroblob(1000000000)</sql>")
    env.step(f"<sql>{numbers()} SELECT count(*) FROM r</sql>")
    env.step("<sql>ATTACH 'x.sqlite' AS x</sql>")
    env.step("<sql>SELECT * FROM missing</sql>")
    out = env.step("<solution>SELECT length(printf('%.*c', 2000000000, 'x'))</solution>")
    assert out.done and out.reward == 0.0 and out.metadata["failure"] == "timeout"
    assert env.get_metrics() == {"sql_calls": 5.0, "sql_errors": 5.0, "timeouts": 2.0, "refused": 1.0,
                                 "too_large": 1.0, "crashed": 0.0, "solved": 0.0}


@pytest.fixture()
def zoo(tmp_path: Path, db: Path) -> Path:
    """``db`` in skyrl-gym's layout, ``<db_path>/spider/database/toy/toy.sqlite``."""
    target = tmp_path / "sql_data" / "spider" / "database" / "toy" / "toy.sqlite"
    target.parent.mkdir(parents=True)
    target.write_bytes(db.read_bytes())
    return tmp_path / "sql_data"


def test_text2sql_env_scores_bombs_zero_and_counts_them(zoo, monkeypatch):
    from ridgeline.envs import text2sql

    monkeypatch.setattr(text2sql, "EXPLORE_TIMEOUT_S", TIMEOUT)
    monkeypatch.setattr(text2sql, "SCORE_TIMEOUT_S", TIMEOUT)
    row = {"db_id": "toy", "data": "spider", "reward_spec": {"method": "rule", "ground_truth": "SELECT 1"}}
    env = make("text2sql", env_config={"db_path": str(zoo), "max_turns": 5}, extras=row)
    think = "<think>t</think>"
    out = env.step(f"{think}<sql>SELECT zeroblob(1000000000)</sql>")
    assert "Error executing SQL: string or blob too big" in out.observations[0]["content"]
    out = env.step(f"{think}<sql>SELECT length(printf('%.*c', 2000000000, 'x'))</sql>")
    assert "SQL Timeout" in out.observations[0]["content"]
    out = env.step(f"{think}<sql>ATTACH 'x.sqlite' AS x</sql>")
    assert "not allowed: ATTACH" in out.observations[0]["content"]
    out = env.step(f"{think}<solution>{numbers()} SELECT n FROM r</solution>")
    assert out.done and out.reward == 0.0
    assert env.get_metrics() == {"sql_calls": 4.0, "sql_errors": 4.0, "timeouts": 2.0, "refused": 1.0,
                                 "too_large": 1.0, "crashed": 0.0}
    env = make("text2sql", env_config={"db_path": str(zoo), "max_value_bytes": 1024}, extras=row)
    out = env.step(f"{think}<sql>SELECT zeroblob(2000)</sql>")
    assert "too big" in out.observations[0]["content"]


def test_text2sql_tables_past_4500_rows_render_as_skyrl_gym_does(zoo):
    """More than 4500 rows are never rendered whole (each row line is at least 2 characters, so
    the table is over 9000): the cut table must still be skyrl-gym's, column types included."""
    pd = pytest.importorskip("pandas")
    from ridgeline.envs.text2sql import _table

    for last in (4500, 4501, 6000):
        rows = frozenset((n, None if n % 7 else n * 0.5, f"r{n}") for n in range(1, last + 1))
        text = pd.DataFrame(rows).to_string(index=False)
        if len(text) > 9000:
            text = "Truncated to 50 lines since returned response too long: " + \
                pd.DataFrame(rows).head(50).to_string(index=False)
        assert _table(rows) == text


EXPLORE_SCRIPT = """
import json, resource, sys
from ridgeline.envs import make
row = {"db_id": "toy", "data": "spider", "reward_spec": {"method": "rule", "ground_truth": "SELECT 1"}}
env = make("text2sql", env_config={"db_path": sys.argv[1], "max_turns": 5}, extras=row)
env.step("<think>t</think><sql>SELECT 1</sql>")  # the worker, pandas and caches exist before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = env.step("<think>t</think><sql>" + sys.argv[2] + "</sql>")
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
kept = max(len(m) for m in env.messages)
print(json.dumps({"grown_kib": grown, "observation": out.observations[0]["content"], "kept": kept}))
"""


def test_text2sql_exploration_rows_are_a_preview_cut_in_the_worker(zoo):
    """One <sql> step returning 7 cells of 8 MB: before, the trainer went from 134 to 498 MiB and
    kept a 64 MB observation for the episode; now the worker sends each cell cut to 9000
    characters and the observation is skyrl-gym's cut table, at most 100000 characters."""
    import json

    sql = f"{numbers(7)} SELECT n, printf('%.*c', 8000000, 'x') AS big FROM r"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", EXPLORE_SCRIPT, str(zoo), sql], env=env, capture_output=True,
                         text=True, timeout=HANG_GUARD_S, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    observation = report["observation"]
    assert observation.startswith("\n\n<observation>Truncated to 50 lines since returned response too long: ")
    assert "x" * 9000 + "..." in observation and "x" * 9001 not in observation
    assert len(observation) < 100_000 + 200 and report["kept"] < 100_000 + 200
    assert report["grown_kib"] < 32 * 1024, report

    from ridgeline.envs.sql_executor import SQLLimits, run_in_rollback
    from ridgeline.envs.text2sql import PREVIEW, _table
    # the preview stops reading at its row count or its bytes, in the worker, and says so
    rows = run_in_rollback(zoo / "spider/database/toy/toy.sqlite", f"{numbers(10000)} SELECT n FROM r", SQLLimits(),
                           PREVIEW)
    assert len(rows.rows) == 4501 and rows.truncated
    wide = run_in_rollback(zoo / "spider/database/toy/toy.sqlite",
                           f"{numbers(1000)} SELECT printf('%.*c', 5000, 'y') FROM r", SQLLimits(), PREVIEW)
    assert wide.truncated and 50 < len(wide.rows) < 200 and wide.failure is None
    # a table skyrl-gym shows whole is shown the same
    small = run_in_rollback(zoo / "spider/database/toy/toy.sqlite", f"{numbers(30)} SELECT n, n * 0.5 FROM r",
                            SQLLimits(), PREVIEW)
    assert not small.truncated
    pd = pytest.importorskip("pandas")
    assert _table(frozenset(small.rows)) == pd.DataFrame(frozenset(small.rows)).to_string(index=False)


def test_limit_settings_are_checked(db):
    with pytest.raises(ValueError, match="max_result_bytes.*Fix"):
        env_for(db, "SELECT 1", max_result_bytes=10)
    with pytest.raises(ValueError, match="timeout_s.*Fix"):
        env_for(db, "SELECT 1", timeout_s=0)
    with pytest.raises(ValueError, match="max_value_bytes.*Fix"):
        SQLLimits(max_value_bytes=0)


def test_workers_get_no_environment_of_the_trainer(db, monkeypatch):
    monkeypatch.setenv("RIDGELINE_TEST_SECRET", "hunter2")
    limits = SQLLimits(max_value_bytes=3 * 1024 * 1024 + 7)  # a pool of its own: its worker starts now
    run_query(db, "SELECT 1", limits=limits)
    [worker] = sql_executor._pool(sql_executor.worker_memory_bytes(limits))._idle
    environ = Path(f"/proc/{worker.proc.pid}/environ").read_bytes().split(b"\0")
    assert not any(b"hunter2" in entry for entry in environ)
    assert {entry.split(b"=")[0] for entry in environ if entry} <= {b"MALLOC_ARENA_MAX", b"TMPDIR", b"SQLITE_TMPDIR"}


def test_a_frame_cannot_name_a_class():
    """Replies are decoded without loading any class or function, so a worker that was taken
    over cannot run code in the trainer through pickle."""
    import pickle

    from ridgeline.envs import sql_worker

    evil = pickle.dumps((os.system, ("true",)))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        sql_worker.decode(evil)
    assert sql_executor._decode(evil) is None


# --- parsers: linear time on hostile responses ----------------------------------------------------

MB = 1024 * 1024
# CPU seconds of the calling thread (time.thread_time: what the parser costs, not how busy the
# machine is); generous: each call below takes milliseconds, the old code seconds to minutes
PARSER_BOUND_S = 1.0

LENIENT_BOMBS = {
    "unclosed thinks": "<think>" * (MB // 7) + "<sql>SELECT 1</sql>",
    "spaces before a fence": "<sql>SELECT 1" + " " * MB + "x</sql>",
    "newlines before a fence": "<sql>```sql\n" + "\n" * MB + "SELECT 1 x",
    "open tags": "<sql>" * (MB // 5),
    "open solutions": "<solution>" * (MB // 10),
    "think case soup": "<THINK><think>" * (MB // 14) + "</sql>",
}
SKYRL_BOMBS = {
    "unclosed thinks": "<think>" * (MB // 7) + "<solution>SELECT 1</solution>",
    "observation ends": "<think>x</think>" + "</observation>" * (MB // 14) + "<solution>SELECT 1</solution>",
    "observation ends and spaces": ("</observation>" + " " * 50) * (MB // 64) + "<solution>x</solution><think></think>",
    "open sql tags": "<sql>" * (MB // 5),
}
STATEMENT_BOMBS = {
    "trailing spaces mid-text": "SELECT 1" + " " * MB + "x",
    "semicolons": "SELECT 1" + ";" * MB + "x",
    "open comment": "/*" + "*" * MB,
    "line comments": "--\n" * (MB // 3) + "SELECT 1",
}


def timed(call) -> float:
    """CPU seconds ``call`` costs this thread (an SQL worker's time is its own process's)."""
    started = time.thread_time()
    call()
    return time.thread_time() - started


@pytest.mark.parametrize("name", LENIENT_BOMBS)
def test_lenient_reading_is_linear(name):
    text = LENIENT_BOMBS[name]
    assert timed(lambda: (extract_tag(text, "sql"), extract_tag(text, "solution"))) < PARSER_BOUND_S


@pytest.mark.parametrize("name", SKYRL_BOMBS)
def test_skyrl_reading_is_linear(name):
    text = SKYRL_BOMBS[name]
    assert timed(lambda: (verified_solution(text), first_sql_block(text))) < PARSER_BOUND_S


@pytest.mark.parametrize("name", STATEMENT_BOMBS)
def test_statement_checks_are_linear(db, name):
    from ridgeline.envs.sql_worker import statement_refusal, strip_terminators

    sql = STATEMENT_BOMBS[name]
    assert timed(lambda: statement_refusal(strip_terminators(sql))) < PARSER_BOUND_S
    result = run_query(db, sql, limits=UNTIMED)
    assert result.failure in ("sql_error", "refused") or result.ok


def test_lenient_env_steps_on_hostile_responses_quickly(db):
    env = env_for(db, "SELECT 1", max_turns=len(LENIENT_BOMBS) + 1)
    for text in LENIENT_BOMBS.values():
        assert timed(lambda: env.step(text)) < PARSER_BOUND_S


# The reading rules, written the old way (regular expressions that backtrack): the linear
# versions must agree with them on every input. skyrl-gym's own functions are the reference for
# text2sql where it is installed.
_OLD_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_OLD_TAG = {tag: re.compile(rf"<{tag}>(.*?)(?:</{tag}>|\Z)", re.DOTALL | re.IGNORECASE) for tag in ("sql", "solution")}
_OLD_FENCE = re.compile(r"^\s*```[A-Za-z]*\s*\n?|\n?\s*```\s*$")


def old_extract_tag(text: str, tag: str) -> str | None:
    matches = _OLD_TAG[tag].findall(_OLD_THINK.sub("", text))
    return None if not matches else _OLD_FENCE.sub("", matches[-1]).strip()


def old_strip_terminators(sql: str) -> str:
    return re.sub(r"[\s;]+\Z", "", sql)


_OLD_COMMENT_OR_SPACE = re.compile(r"(?:\s+|--[^\n]*(?:\n|\Z)|/\*.*?(?:\*/|\Z))", re.DOTALL)


def old_first_token(sql: str) -> str:
    position = 0
    while (match := _OLD_COMMENT_OR_SPACE.match(sql, position)) and match.end() > position:
        position = match.end()
    return sql[position:]


PIECES = ["--", "/*", "*/", "*", "-", "DROP",
          "<think>", "</think>", "<THINK>", "</Think>", "<sql>", "</sql>", "<SQL>", "</Sql>", "<solution>",
          "</solution>", "<Solution>", "</observation>", "</OBSERVATION>", "```", "```sql", "\n", " ", "\t", ";",
          "\u00a0", "\u2028", "SELECT 1", "x", "<", ">", "/", "`", "\u212athink>", "<th\u0130nk>", "<\u212a"]


def soups(seed: int, count: int = 3000):
    rng = random.Random(seed)
    for _ in range(count):
        yield "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 14)))


def test_lenient_reading_agrees_with_the_old_rules():
    for text in soups(0):
        for tag in ("sql", "solution"):
            assert extract_tag(text, tag) == old_extract_tag(text, tag), (text, tag)


def test_statement_checks_agree_with_the_old_rules():
    from ridgeline.envs.sql_worker import _LEADING_NOISE, strip_terminators

    for text in soups(1):
        assert strip_terminators(text) == old_strip_terminators(text), text
        assert text[_LEADING_NOISE.match(text).end():] == old_first_token(text), text


def test_skyrl_reading_agrees_with_skyrl_gym():
    utils = pytest.importorskip("skyrl_gym.envs.sql.utils")
    for text in soups(2, count=5000):
        ok, _, solution, _ = utils.verify_format_and_extract(text)
        assert verified_solution(text) == (solution if ok else None), text
        match = re.search(r"<sql>(.*?)</sql>", text, re.DOTALL)
        assert first_sql_block(text) == (match.group(1) if match else None), text
