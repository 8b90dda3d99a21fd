"""text2sql_lenient: the read-only SQLite executor, result comparison, the multi-turn env and the
synthetic dataset, all on real SQLite files. (skyrl-gym's exact text2sql: test_skyrl_envs.py.)"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from ridgeline.data import PromptDataset
from ridgeline.data.prepare_text2sql import DB_ID, prepare_text2sql, shop_questions
from ridgeline.envs import make
from ridgeline.envs.sql_executor import SQLLimits, has_top_level_order_by, results_match, run_query
from ridgeline.envs.text2sql_lenient import extract_tag

ENDLESS = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    path = tmp_path / "toy.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE pets (id INTEGER PRIMARY KEY, name TEXT, species TEXT, age INTEGER, weight REAL);
        CREATE TABLE owners (id INTEGER PRIMARY KEY, name TEXT, pet_id INTEGER);
        """
    )
    pets = [(i, f"pet{i}", ("cat", "dog", "fish")[i % 3], i % 7, 1.5 * i) for i in range(1, 51)]
    conn.executemany("INSERT INTO pets VALUES (?, ?, ?, ?, ?)", pets)
    conn.executemany("INSERT INTO owners VALUES (?, ?, ?)", [(i, f"owner{i}", i * 2) for i in range(1, 11)])
    conn.commit()
    conn.close()
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def contents(path: Path) -> list:
    conn = sqlite3.connect(path)
    try:
        return [conn.execute(f"SELECT * FROM {t} ORDER BY id").fetchall() for t in ("pets", "owners")]
    finally:
        conn.close()


# --- executor: reads and limits -------------------------------------------------------------


def test_run_query_returns_python_values_and_columns(db):
    result = run_query(db, "SELECT name, age, weight, NULL AS missing FROM pets WHERE id = 3")
    assert result.ok and not result.truncated and not result.timed_out
    assert result.columns == ["name", "age", "weight", "missing"]
    assert result.rows == [("pet3", 3, 4.5, None)]


def test_row_limit_truncates(db):
    result = run_query(db, "SELECT id FROM pets ORDER BY id", max_rows=7)
    assert result.ok and result.truncated
    assert result.rows == [(i,) for i in range(1, 8)]
    exact = run_query(db, "SELECT id FROM pets", max_rows=50)
    assert len(exact.rows) == 50 and not exact.truncated


def test_endless_recursive_cte_times_out(db):
    # the query never ends on its own: returning at all is the time limit at work (no clock asserts)
    result = run_query(db, ENDLESS, limits=SQLLimits(timeout_s=0.3))
    assert result.timed_out and result.rows is None and "timed out" in result.error


def test_endless_cte_with_row_limit_stops_at_the_limit(db):
    result = run_query(db, "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT n FROM r",
                       max_rows=5, limits=SQLLimits(timeout_s=1.0), digest=False)
    assert result.ok and result.truncated and result.rows == [(1,), (2,), (3,), (4,), (5,)]
    # an answer is read in full (for its digest), so an endless one runs into the time limit
    result = run_query(db, "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT n FROM r",
                       max_rows=5, limits=SQLLimits(timeout_s=0.5))
    assert result.timed_out and result.rows is None


@pytest.mark.parametrize("sql", ["SELECT * FROM nope", "SELEC 1", "SELECT (", "", "   ", "-- nothing", "SELECT '\x00'",
                                 "SELECT 1 FROM pets WHERE", "\x00\ufffd garbage"])
def test_bad_sql_is_an_error_result(db, sql):
    result = run_query(db, sql)
    assert not result.ok and result.rows is None and result.error


def test_trailing_semicolons_and_comments_are_fine(db):
    assert run_query(db, "SELECT 1;; ").rows == [(1,)]
    assert run_query(db, "/* hi */ -- there\nSELECT 2; -- done").rows == [(2,)]


def test_introspection_reads_are_allowed(db):
    assert run_query(db, "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").rows == [("owners",), ("pets",)]
    assert [r[1] for r in run_query(db, "PRAGMA table_info(pets)").rows] == ["id", "name", "species", "age", "weight"]


def test_missing_database_raises_with_path(tmp_path):
    missing = tmp_path / "nope.sqlite"
    with pytest.raises(FileNotFoundError, match="nope.sqlite"):
        run_query(missing, "SELECT 1")
    assert not missing.exists()


def test_huge_values_are_refused_not_allocated(db):
    result = run_query(db, "SELECT zeroblob(500000000)")
    assert not result.ok


# --- executor: nothing can change the database ---------------------------------------------

WRITES = [
    "DROP TABLE pets",
    "DELETE FROM pets",
    "UPDATE pets SET age = 99",
    "INSERT INTO pets (name) VALUES ('x')",
    "CREATE TABLE t (x)",
    "CREATE INDEX i ON pets(age)",
    "CREATE VIEW v AS SELECT 1",
    "ALTER TABLE pets ADD COLUMN y",
    "DETACH main",
    "VACUUM",
    "REINDEX",
    "ANALYZE",
    "BEGIN",
    "REPLACE INTO pets (id, name) VALUES (1, 'x')",
    "PRAGMA journal_mode=delete",
    "PRAGMA journal_mode=wal",
    "PRAGMA user_version=5",
    "PRAGMA writable_schema=ON",
    "PRAGMA optimize",
    "SELECT 1; DROP TABLE pets",
    "SELECT 1; DELETE FROM pets;",
    # DML behind WITH passes the first-keyword check, so the authorizer must catch it.
    "WITH x AS (SELECT 1) DELETE FROM pets",
    "WITH x AS (SELECT 1) UPDATE pets SET age = 0",
    "WITH x AS (SELECT 1) INSERT INTO pets (name) SELECT 'x' FROM x",
    "SELECT load_extension('libnothing')",
]


@pytest.mark.parametrize("sql", WRITES)
def test_writes_are_refused_and_the_file_is_unchanged(db, sql):
    before_hash, before_rows = digest(db), contents(db)
    before_files = sorted(p.name for p in db.parent.iterdir())
    result = run_query(db, sql)
    assert not result.ok and result.rows is None, result
    assert digest(db) == before_hash
    assert contents(db) == before_rows
    assert sorted(p.name for p in db.parent.iterdir()) == before_files


@pytest.mark.parametrize("template", ["ATTACH DATABASE '{p}' AS other", "VACUUM INTO '{p}'",
                                      "ATTACH 'file:{p}?mode=rwc' AS other"])
def test_attach_or_vacuum_into_creates_no_file(db, tmp_path, template):
    target = tmp_path / "created.sqlite"
    before_hash = digest(db)
    result = run_query(db, template.format(p=target))
    assert not result.ok
    assert not target.exists()
    assert digest(db) == before_hash


def test_authorizer_error_names_what_was_denied(db):
    result = run_query(db, "WITH x AS (SELECT 1) DELETE FROM pets")
    assert "DELETE" in result.error and "read-only" in result.error


# --- result comparison ------------------------------------------------------------------------


def test_results_match_ignores_order_unless_asked():
    assert results_match([(1, "a"), (2, "b")], [(2, "b"), (1, "a")])
    assert not results_match([(1, "a"), (2, "b")], [(2, "b"), (1, "a")], order_matters=True)
    assert results_match([(1, "a"), (2, "b")], [(1, "a"), (2, "b")], order_matters=True)


def test_results_match_counts_duplicates():
    assert not results_match([(1,), (1,), (2,)], [(1,), (2,), (2,)])
    assert not results_match([(1,), (2,)], [(1,), (1,), (2,)])
    assert results_match([(1,), (2,), (1,)], [(1,), (1,), (2,)])


def test_results_match_numbers():
    assert results_match([(2,)], [(2.0,)])
    assert results_match([(0.1 + 0.2,)], [(0.3,)])
    assert results_match([(1234.5678,)], [(1234.5678 * (1 + 1e-9),)])
    assert not results_match([(1.0,)], [(1.001,)])
    assert not results_match([(1_000_000,)], [(1_000_001,)])  # ints are exact
    assert not results_match([("1",)], [(1,)])
    assert not results_match([(None,)], [(0,)])
    assert results_match([(None, 1)], [(None, 1)])
    # float noise must not change how rows line up
    assert results_match([(1.0, "b"), (1.0 + 1e-12, "a")], [(1.0 + 1e-12, "b"), (1.0, "a")])


def test_results_match_shapes():
    assert not results_match([(1, 2)], [(1,)])
    assert not results_match([(1, 2)], [(2, 1)])  # column order matters
    assert results_match([], [])
    assert not results_match(None, [])
    assert not results_match([(1,)], None)


def test_top_level_order_by_detection():
    assert has_top_level_order_by("SELECT a FROM t ORDER BY a")
    assert has_top_level_order_by("select a from t order\n  by a desc limit 3")
    assert not has_top_level_order_by("SELECT a FROM (SELECT a FROM t ORDER BY a LIMIT 3)")
    assert not has_top_level_order_by("SELECT 'order by' FROM t")
    assert not has_top_level_order_by("SELECT row_number() OVER (ORDER BY a) FROM t")
    assert not has_top_level_order_by("SELECT a FROM t -- order by a")


# --- env --------------------------------------------------------------------------------------


def env_for(db: Path, gold: str, **settings):
    extras = {"reward_spec": {"method": "rule", "ground_truth": gold}, "extra_info": {"db_id": db.stem}}
    return make("text2sql_lenient", extras=extras, db_root=str(db.parent), **settings)


GOLD_CATS = "SELECT name FROM pets WHERE species = 'cat'"


def test_exploratory_sql_returns_rows_as_observation(db):
    env = env_for(db, GOLD_CATS)
    out = env.step("Let me look.\n<sql>SELECT id, name FROM pets ORDER BY id</sql>")
    assert not out.done and out.reward == 0.0
    [message] = out.observations
    assert message["role"] == "user"
    text = message["content"]
    assert text.startswith("<observation>") and text.endswith("</observation>")
    assert "pet1" in text and "pet10" in text and "pet11" not in text  # 10 rows shown
    assert "10 of 50 rows" in text
    assert out.metadata["sql"] == "SELECT id, name FROM pets ORDER BY id" and out.metadata["error"] is None


def test_exploratory_error_is_shown(db):
    env = env_for(db, GOLD_CATS)
    out = env.step("<sql>SELECT * FROM cats</sql>")
    assert not out.done and "no such table" in out.observations[0]["content"]
    assert "no such table" in out.metadata["error"]
    out = env.step("<sql>DROP TABLE pets</sql>")
    assert "not allowed" in out.observations[0]["content"]


def test_correct_solution_scores_one(db):
    env = env_for(db, GOLD_CATS)
    out = env.step("<sql>SELECT DISTINCT species FROM pets</sql>")
    assert not out.done
    out = env.step("<think>maybe <solution>SELECT 1</solution></think>\n<solution>\nSELECT name FROM pets WHERE species = 'cat'\n</solution>")
    assert out.done and out.reward == 1.0 and out.observations == []
    assert env.get_metrics() == {"sql_calls": 2.0, "sql_errors": 0.0, "timeouts": 0.0, "refused": 0.0,
                                 "too_large": 0.0, "crashed": 0.0, "solved": 1.0}


def test_wrong_solution_scores_zero(db):
    env = env_for(db, GOLD_CATS)
    out = env.step("<solution>SELECT name FROM pets WHERE species = 'dog'</solution>")
    assert out.done and out.reward == 0.0
    assert env.get_metrics()["solved"] == 0.0
    env = env_for(db, GOLD_CATS)
    assert env.step("<solution>SELECT name, age FROM pets WHERE species = 'cat'</solution>").reward == 0.0


@pytest.mark.parametrize("answer", [
    "SELECT p.name AS cat_name FROM pets AS p WHERE p.species = 'cat'",
    "SELECT name FROM pets WHERE species = 'cat' ORDER BY name DESC",  # extra ORDER BY is harmless
    "```sql\nSELECT name FROM pets WHERE species IN ('cat')\n```",
    "SELECT name FROM pets WHERE id % 3 = 0;",
])
def test_equivalent_solutions_score_one(db, answer):
    assert env_for(db, GOLD_CATS).step(f"<solution>{answer}</solution>").reward == 1.0


def test_equivalent_join_order_scores_one(db):
    gold = "SELECT o.name, p.name FROM owners AS o JOIN pets AS p ON p.id = o.pet_id"
    answer = "SELECT owners.name, pets.name AS pet FROM pets JOIN owners ON owners.pet_id = pets.id"
    assert env_for(db, gold).step(f"<solution>{answer}</solution>").reward == 1.0


def test_ordered_gold_requires_order(db):
    gold = "SELECT name FROM pets ORDER BY weight DESC LIMIT 3"
    assert env_for(db, gold).step("<solution>SELECT name FROM pets ORDER BY weight DESC LIMIT 3</solution>").reward == 1.0
    wrong_order = "SELECT name FROM (SELECT name, weight FROM pets ORDER BY weight DESC LIMIT 3) ORDER BY weight"
    assert env_for(db, gold).step(f"<solution>{wrong_order}</solution>").reward == 0.0


def test_float_answers_within_tolerance(db):
    gold = "SELECT AVG(weight) FROM pets"
    assert env_for(db, gold).step("<solution>SELECT SUM(weight) / COUNT(*) FROM pets</solution>").reward == 1.0


def test_no_tags_gets_format_reminder_then_last_turn_ends(db):
    env = env_for(db, GOLD_CATS, max_turns=2)
    out = env.step("I think the answer is the cats.")
    assert not out.done and out.reward == 0.0
    assert "<sql>" in out.observations[0]["content"] and "<solution>" in out.observations[0]["content"]
    assert "last" in out.observations[0]["content"]  # one turn left: told to answer
    out = env.step("still no tags")
    assert out.done and out.reward == 0.0 and out.observations == []


def test_sql_on_last_turn_is_the_answer(db):
    env = env_for(db, GOLD_CATS, max_turns=2)
    assert not env.step("<sql>SELECT 1</sql>").done
    out = env.step("<sql>SELECT name FROM pets WHERE species = 'cat'</sql>")
    assert out.done and out.reward == 1.0 and out.metadata["kind"] == "sql_on_last_turn"


def test_default_max_turns_is_five(db):
    env = env_for(db, GOLD_CATS)
    outs = [env.step("<sql>SELECT 1</sql>") for _ in range(5)]
    assert [o.done for o in outs] == [False] * 4 + [True]


def test_metrics_count_calls_errors_and_timeouts(db):
    env = env_for(db, GOLD_CATS, timeout_s=0.2, max_turns=6)
    env.step("<sql>SELECT 1</sql>")
    env.step("<sql>SELECT * FROM missing</sql>")
    out = env.step(f"<sql>{ENDLESS}</sql>")
    assert "timed out" in out.observations[0]["content"] and out.metadata["timed_out"]
    env.step("no tags")  # not a SQL call
    env.step("<sql>DELETE FROM pets</sql>")
    assert env.step("<solution>SELECT name FROM pets WHERE species = 'dog'</solution>").done
    assert env.get_metrics() == {"sql_calls": 5.0, "sql_errors": 3.0, "timeouts": 1.0, "refused": 1.0,
                                 "too_large": 0.0, "crashed": 0.0, "solved": 0.0}


GARBAGE = [
    "", "   ", None, 12345, "<sql>", "<sql></sql>", "<solution>", "</solution><solution>", "<sql><sql></sql></sql>",
    "<SQL>SELECT 1</SQL>", "<solution>" + "x" * 100_000, "\x00\x01\ufffd\U0001f600", "<sql>SELECT '" + "'" * 5000 + "</sql>",
    "<sql>SELECT 1; DROP TABLE pets</sql>", "<think>unclosed <solution>SELECT 1",
]


@pytest.mark.parametrize("text", GARBAGE)
def test_garbage_never_raises(db, text):
    before = digest(db)
    env = env_for(db, GOLD_CATS, max_turns=2)
    first = env.step(text)
    assert first.reward in (0.0, 1.0)
    if not first.done:
        assert env.step(text).done
    assert digest(db) == before
    assert set(env.get_metrics()) == {"sql_calls", "sql_errors", "timeouts", "refused", "too_large", "crashed",
                                      "solved"}


def test_extract_tag():
    assert extract_tag("<sql>a</sql> then <sql>b</sql>", "sql") == "b"
    assert extract_tag("<sql>SELECT 1", "sql") == "SELECT 1"  # stopped before the closing tag
    assert extract_tag("<think><sql>x</sql></think>", "sql") is None
    assert extract_tag("no tags", "solution") is None


def test_config_errors_fail_at_construction(db, tmp_path):
    good = {"reward_spec": {"ground_truth": GOLD_CATS}, "extra_info": {"db_id": db.stem}}
    with pytest.raises(ValueError, match="db_root"):
        make("text2sql_lenient", extras=good)
    with pytest.raises(FileNotFoundError, match="nope"):
        make("text2sql_lenient", extras={**good, "extra_info": {"db_id": "nope"}}, db_root=str(db.parent))
    with pytest.raises(ValueError, match="ground_truth"):
        make("text2sql_lenient", extras={"extra_info": {"db_id": db.stem}}, db_root=str(db.parent))
    with pytest.raises(TypeError, match="unknown settings"):
        make("text2sql_lenient", extras=good, db_root=str(db.parent), timeout=3)
    # an absolute db_path needs no db_root; the Spider layout <root>/<id>/<id>.sqlite is found
    env = make("text2sql_lenient", extras={**good, "extra_info": {"db_path": str(db)}})
    assert env.step(f"<solution>{GOLD_CATS}</solution>").reward == 1.0
    nested = tmp_path / "spider" / "zoo" / "zoo.sqlite"
    nested.parent.mkdir(parents=True)
    nested.write_bytes(db.read_bytes())
    env = make("text2sql_lenient", extras={**good, "extra_info": {"db_id": "zoo"}}, db_root=str(tmp_path / "spider"))
    assert env.step(f"<solution>{GOLD_CATS}</solution>").reward == 1.0


def test_bad_gold_sql_scores_zero_without_raising(db):
    env = env_for(db, "SELECT * FROM not_a_table")
    out = env.step("<solution>SELECT 1</solution>")
    assert out.done and out.reward == 0.0 and "no such table" in out.metadata["gold_error"]


# --- the synthetic dataset --------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Path]:
    return prepare_text2sql(tmp_path_factory.mktemp("text2sql"), num_val=30, seed=0)


def test_prepare_writes_database_and_splits(prepared):
    assert (prepared["databases"] / f"{DB_ID}.sqlite").is_file()
    train, val = PromptDataset(prepared["train"]), PromptDataset(prepared["validation"])
    assert len(val) == 30 and len(train) > 100
    train_q = {row.prompt[-1]["content"] for row in train}
    assert not train_q & {row.prompt[-1]["content"] for row in val}
    row = train[0]
    assert row.env_class == "text2sql_lenient" and row.data_source == "synthetic_sql"
    assert row.extra_info["db_id"] == DB_ID
    assert [m["role"] for m in row.prompt] == ["system", "user"]
    system = row.prompt[0]["content"]
    assert "CREATE TABLE order_items" in system and "<sql>" in system and "<solution>" in system
    assert len({r.extra_info["template"] for r in train}) >= 15


def test_prepare_is_deterministic(prepared, tmp_path):
    again = prepare_text2sql(tmp_path, num_val=30, seed=0)
    assert digest(again["databases"] / "shop.sqlite") == digest(prepared["databases"] / "shop.sqlite")
    assert again["train"].read_bytes() == prepared["train"].read_bytes()


def test_every_gold_answer_scores_one_through_the_env(prepared):
    db_root = str(prepared["databases"])
    rows = list(PromptDataset([prepared["train"], prepared["validation"]]))
    for row in rows:
        gold = row.reward_spec["ground_truth"]
        result = run_query(prepared["databases"] / "shop.sqlite", gold)
        assert result.ok and result.rows, (gold, result.error)
        env = make(row.env_class, extras=row.extras, db_root=db_root)
        out = env.step(f"Answer:\n<solution>{gold}</solution>")
        assert out.done and out.reward == 1.0, gold


def test_all_templates_have_valid_sql():
    questions = shop_questions()
    assert len({q.template for q in questions}) >= 15
    assert len({q.question for q in questions}) == len(questions)
