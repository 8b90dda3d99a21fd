"""A small synthetic text-to-SQL dataset on a generated SQLite database, for the ``text2sql_lenient`` env.

Writes, under ``output_dir``::

    databases/shop.sqlite     customers, products, orders, order_items (fixed, deterministic rows)
    train.parquet             questions with their gold SQL (SkyRL rows, env_class "text2sql_lenient")
    validation.parquet

Training needs the database folder in the env config::

    environment:
      skyrl_gym:
        text2sql_lenient:
          db_root: <output_dir>/databases

The rows are not for skyrl-gym's ``text2sql`` env: that one needs its Spider/BIRD/SynSQL folder
layout and ``<think>`` sections, which a small model prompted like this one does not write.

Questions come from ~20 templates (counts, filters, joins, GROUP BY/HAVING, ORDER BY/LIMIT,
subqueries) filled with constants drawn from the data; questions whose answer would be empty are
left out, so every question has a definite, non-empty answer.
The database does not depend on ``seed``; ``seed`` only decides which questions go to which split.
Validation questions are drawn first and never appear in train; when ``num_train`` exceeds the
questions left, train repeats them in reshuffled passes (with a warning). Every gold query is run
on the written database before the parquet files are written, so a template bug fails here rather
than as a silent zero reward. About 175 distinct questions exist.

Ordered questions (ORDER BY in the gold SQL, where the env compares row order) sort on columns
whose values are distinct, so no correct answer can lose on how ties happen to be ordered.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dataset import write_parquet
from .schema import arrow_schema

__all__ = ["prepare_text2sql", "build_shop_database", "shop_questions", "Question", "SYSTEM_PROMPT", "DB_ID"]

logger = logging.getLogger(__name__)

DB_ID = "shop"
DATA_SOURCE = "synthetic_sql"
_DB_SEED = 20240501  # fixed: the database is the same whatever the split seed

SYSTEM_PROMPT = """You are a careful data analyst who answers questions by writing SQLite queries.

Database schema:
{schema}

How to work:
- To look at the data, write one query inside <sql>...</sql> and end your response. Its result (or the error) comes back inside <observation>...</observation>.
- When you are sure, write your final query inside <solution>...</solution>. It is run and its result is compared with the correct answer's result, so select exactly the columns the question asks for, in that order, and sort only when the question asks for an order.
- You have a few turns; your last response must contain the <solution>. Only read-only queries are allowed."""

_CITIES = ("Lisbon", "Oslo", "Denver", "Osaka", "Nairobi")
_STATUSES = ("shipped", "pending", "cancelled")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")
_CUSTOMER_NAMES = (
    "Ana Silva", "Bjorn Dahl", "Chloe Martin", "Daisuke Ito", "Esther Mwangi", "Felix Wagner", "Grace Kim",
    "Hugo Costa", "Ingrid Berg", "James Carter", "Kenji Sato", "Lucia Romero", "Mateo Lopez", "Nadia Ouma",
    "Oscar Nilsson", "Priya Nair", "Quinn Harper", "Rosa Pereira", "Samuel Otieno", "Tara Walsh",
)
# (name, category, price); prices are distinct so ORDER BY price has no ties.
_PRODUCTS = (
    ("The Silent Forest", "Books", 12.5), ("Data at Dawn", "Books", 24.0), ("Cooking with Rice", "Books", 18.75),
    ("Atlas of Rivers", "Books", 39.9), ("USB-C Cable", "Electronics", 9.99), ("Wireless Mouse", "Electronics", 27.5),
    ("Noise Cancelling Headphones", "Electronics", 149.0), ("Smart Speaker", "Electronics", 79.0),
    ("Trowel", "Garden", 14.25), ("Garden Hose", "Garden", 32.0), ("Seed Pack", "Garden", 4.5),
    ("Pruning Shears", "Garden", 21.0), ("Puzzle Cube", "Toys", 11.0), ("Wooden Train", "Toys", 45.0),
    ("Kite", "Toys", 16.5), ("Board Game", "Toys", 29.95),
)
# One product per category is never ordered, so "never ordered" questions have answers.
_NEVER_ORDERED = frozenset({"Atlas of Rivers", "Smart Speaker", "Pruning Shears", "Kite"})
_NUM_ORDERS = 45

_SCHEMA_SQL = """
CREATE TABLE customers (
    customer_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    city TEXT NOT NULL,
    signup_date TEXT NOT NULL  -- YYYY-MM-DD
);
CREATE TABLE products (
    product_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    category TEXT NOT NULL,
    price REAL NOT NULL
);
CREATE TABLE orders (
    order_id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL REFERENCES customers(customer_id),
    order_date TEXT NOT NULL,  -- YYYY-MM-DD
    status TEXT NOT NULL       -- 'shipped', 'pending' or 'cancelled'
);
CREATE TABLE order_items (
    order_item_id INTEGER PRIMARY KEY,
    order_id INTEGER NOT NULL REFERENCES orders(order_id),
    product_id INTEGER NOT NULL REFERENCES products(product_id),
    quantity INTEGER NOT NULL
);
"""


@dataclass(frozen=True)
class ShopData:
    """The rows of the shop database, as inserted (ids are 1-based list positions)."""

    customers: list[tuple[int, str, str, str]]  # (customer_id, name, city, signup_date)
    products: list[tuple[int, str, str, float]]  # (product_id, name, category, price)
    orders: list[tuple[int, int, str, str]]  # (order_id, customer_id, order_date, status)
    order_items: list[tuple[int, int, int, int]]  # (order_item_id, order_id, product_id, quantity)


@dataclass(frozen=True)
class Question:
    template: str
    question: str
    sql: str


def _shop_data() -> ShopData:
    rng = random.Random(_DB_SEED)
    # Distinct signup dates in shuffled order, so "earliest signups" is not just the lowest ids.
    offsets = rng.sample(range(0, 700, 7), len(_CUSTOMER_NAMES))
    start = dt.date(2022, 3, 1)
    customers = [
        (i + 1, name, rng.choice(_CITIES), (start + dt.timedelta(days=offset)).isoformat())
        for i, (name, offset) in enumerate(zip(_CUSTOMER_NAMES, offsets))
    ]
    products = [(i + 1, name, category, price) for i, (name, category, price) in enumerate(_PRODUCTS)]
    orderable = [p[0] for p in products if p[1] not in _NEVER_ORDERED]
    # The last two customers never order, so LEFT JOIN / zero-count questions mean something.
    buyers = [c[0] for c in customers[:-2]]
    orders: list[tuple[int, int, str, str]] = []
    items: list[tuple[int, int, int, int]] = []
    for order_id in range(1, _NUM_ORDERS + 1):
        date = dt.date(2024, rng.randint(1, 12), rng.randint(1, 28)).isoformat()
        status = rng.choices(_STATUSES, weights=(6, 3, 2))[0]
        orders.append((order_id, rng.choice(buyers), date, status))
        for product_id in sorted(rng.sample(orderable, rng.randint(1, 3))):
            items.append((len(items) + 1, order_id, product_id, rng.randint(1, 5)))
    return ShopData(customers=customers, products=products, orders=orders, order_items=items)


def build_shop_database(path: str | Path) -> Path:
    """Write the shop database to ``path`` (replacing any file there) and return the path.

    The same rows every time. Written to a temporary sibling and renamed, so an interrupted
    run never leaves a half-written database that later looks valid.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    data = _shop_data()
    conn = sqlite3.connect(tmp)
    try:
        conn.executescript(_SCHEMA_SQL)
        conn.executemany("INSERT INTO customers VALUES (?, ?, ?, ?)", data.customers)
        conn.executemany("INSERT INTO products VALUES (?, ?, ?, ?)", data.products)
        conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)", data.orders)
        conn.executemany("INSERT INTO order_items VALUES (?, ?, ?, ?)", data.order_items)
        conn.commit()
    finally:
        conn.close()
    tmp.replace(path)
    return path


def read_schema(db_path: str | Path) -> str:
    """The CREATE TABLE statements of a database, as stored in it, in creation order."""
    conn = sqlite3.connect(Path(db_path).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL ORDER BY rowid").fetchall()
    finally:
        conn.close()
    return "\n".join(sql.strip() + ";" for (sql,) in rows)


def shop_questions() -> list[Question]:
    """Every (template, constants) question over the shop data, in a fixed order."""
    data = _shop_data()
    categories = sorted({p[2] for p in data.products})
    ordered_ids = {item[2] for item in data.order_items}
    ordered_products = [p[1] for p in data.products if p[0] in ordered_ids]
    customer_names = [c[1] for c in data.customers]
    join_oc = "orders AS o JOIN customers AS c ON c.customer_id = o.customer_id"
    q: list[Question] = []

    def add(template: str, question: str, sql: str) -> None:
        q.append(Question(template, question, " ".join(sql.split())))

    for city in _CITIES:
        add("count_customers_city", f"How many customers live in {city}?",
            f"SELECT COUNT(*) FROM customers WHERE city = '{city}'")
        add("status_counts_city",
            f"For orders placed by customers from {city}, how many orders are there with each status? "
            "Give the status and the number of orders.",
            f"SELECT o.status, COUNT(*) FROM {join_oc} WHERE c.city = '{city}' GROUP BY o.status")
        add("orders_per_customer_city",
            f"For every customer from {city}, give their name and how many orders they have placed "
            "(0 for customers without orders).",
            f"""SELECT c.name, COUNT(o.order_id) FROM customers AS c LEFT JOIN orders AS o
                ON o.customer_id = c.customer_id WHERE c.city = '{city}' GROUP BY c.customer_id""")
        for status in _STATUSES:
            add("order_ids_city_status", f"List the ids of the {status} orders placed by customers from {city}.",
                f"SELECT o.order_id FROM {join_oc} WHERE c.city = '{city}' AND o.status = '{status}'")
    for category in categories:
        add("products_in_category", f"List the names of all products in the {category} category.",
            f"SELECT name FROM products WHERE category = '{category}'")
        add("avg_price_category", f"What is the average price of the products in the {category} category?",
            f"SELECT AVG(price) FROM products WHERE category = '{category}'")
        add("most_expensive_in_category", f"What is the name of the most expensive product in the {category} category?",
            f"SELECT name FROM products WHERE category = '{category}' ORDER BY price DESC LIMIT 1")
        add("never_ordered_in_category", f"Which products in the {category} category have never been ordered? Give their names.",
            f"""SELECT name FROM products WHERE category = '{category}'
                AND product_id NOT IN (SELECT product_id FROM order_items)""")
        add("revenue_category",
            f"What is the total revenue (quantity times price) from {category} products, "
            "counting every order except cancelled ones?",
            f"""SELECT SUM(oi.quantity * p.price) FROM order_items AS oi
                JOIN products AS p ON p.product_id = oi.product_id
                JOIN orders AS o ON o.order_id = oi.order_id
                WHERE p.category = '{category}' AND o.status != 'cancelled'""")
    for status in _STATUSES:
        add("count_orders_status", f"How many orders have the status '{status}'?",
            f"SELECT COUNT(*) FROM orders WHERE status = '{status}'")
    for limit in (5, 10, 15, 20, 25, 30, 40, 50, 100):
        add("products_under_price", f"Which products cost less than {limit} dollars? Give their names and prices.",
            f"SELECT name, price FROM products WHERE price < {limit}")
    for k in range(1, 6):
        add("top_k_expensive", f"What are the {k} most expensive products? List their names and prices, most expensive first.",
            f"SELECT name, price FROM products ORDER BY price DESC LIMIT {k}")
        add("earliest_signups",
            f"Which {k} customers signed up first? List their names and signup dates, earliest first.",
            f"SELECT name, signup_date FROM customers ORDER BY signup_date ASC LIMIT {k}")
    for n in range(1, 5):
        add("customers_more_than_n_orders", f"Which customers have placed more than {n} orders? Give their names.",
            f"SELECT c.name FROM {join_oc} GROUP BY c.customer_id HAVING COUNT(*) > {n}")
    for month_index, month in enumerate(_MONTHS, start=1):
        add("customers_ordering_in_month", f"Give the names of the customers who placed at least one order in {month} 2024.",
            f"SELECT DISTINCT c.name FROM {join_oc} WHERE o.order_date LIKE '2024-{month_index:02d}-%'")
        add("orders_in_month", f"How many orders were placed in {month} 2024?",
            f"SELECT COUNT(*) FROM orders WHERE order_date LIKE '2024-{month_index:02d}-%'")
    for name in ordered_products:
        add("units_sold_product", f"How many units of '{name}' have been ordered in total?",
            f"""SELECT SUM(oi.quantity) FROM order_items AS oi JOIN products AS p
                ON p.product_id = oi.product_id WHERE p.name = '{name}'""")
    for name in customer_names:
        add("distinct_products_customer", f"How many different products has {name} ordered?",
            f"""SELECT COUNT(DISTINCT oi.product_id) FROM order_items AS oi
                JOIN orders AS o ON o.order_id = oi.order_id
                JOIN customers AS c ON c.customer_id = o.customer_id WHERE c.name = '{name}'""")
    for order_id in range(1, len(data.orders) + 1):
        add("items_in_order", f"Which products are in order {order_id}? Give each product's name and the quantity.",
            f"""SELECT p.name, oi.quantity FROM order_items AS oi JOIN products AS p
                ON p.product_id = oi.product_id WHERE oi.order_id = {order_id}""")
    return q


def _answerable(db_path: Path, questions: list[Question]) -> list[Question]:
    """Run every gold query once and keep the questions whose answer has rows.

    A failing gold query is a template bug, so it stops the run before any data is written. An
    empty answer would be matched by any query that returns nothing (a wrong filter included),
    so such questions are left out.
    """
    kept = []
    conn = sqlite3.connect(db_path.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        for question in questions:
            try:
                rows = conn.execute(question.sql).fetchall()
            except sqlite3.Error as exc:
                raise RuntimeError(f"gold SQL of template {question.template!r} fails: {exc}: {question.sql}") from exc
            if rows:
                kept.append(question)
    finally:
        conn.close()
    return kept


def _extra_info_fields() -> list[tuple[str, Any]]:
    import pyarrow as pa

    return [("db_id", pa.string()), ("split", pa.string()), ("index", pa.int64()), ("template", pa.string())]


def _split(questions: list[Question], num_train: int | None, num_val: int, seed: int) -> tuple[list[Question], list[Question]]:
    if num_val < 0:
        raise ValueError(f"num_val must be >= 0, got {num_val}")
    if num_val >= len(questions):
        raise ValueError(f"only {len(questions)} distinct questions exist; num_val={num_val} leaves none for training")
    if num_train is not None and num_train < 1:
        raise ValueError(f"num_train must be >= 1 (or None for all), got {num_train}")
    rng = random.Random(seed)
    order = list(questions)
    rng.shuffle(order)
    val, rest = order[:num_val], order[num_val:]
    if num_train is None or num_train <= len(rest):
        return rest[: num_train or len(rest)], val
    logger.warning(
        "text2sql: only %d questions outside validation for num_train=%d; train repeats them (about %.1fx each)",
        len(rest), num_train, num_train / len(rest),
    )
    train = list(rest)
    while len(train) < num_train:
        rng.shuffle(rest)
        train += rest[: num_train - len(train)]
    return train, val


def _row(question: Question, system_prompt: str, split: str, index: int, env_class: str) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": system_prompt}, {"role": "user", "content": question.question}],
        "env_class": env_class,
        "reward_spec": {"method": "rule", "ground_truth": question.sql},
        "extra_info": {"db_id": DB_ID, "split": split, "index": index, "template": question.template},
    }


def prepare_text2sql(
    output_dir: str | Path,
    *,
    num_train: int | None = None,
    num_val: int = 40,
    seed: int = 0,
    env_class: str = "text2sql_lenient",
) -> dict[str, Path]:
    """Write ``databases/shop.sqlite``, ``train.parquet`` and ``validation.parquet``.

    Args:
        num_train: training rows; None (default) = every question not held out for validation.
        num_val: held-out validation questions (distinct from train).
        seed: decides the split; same seed and sizes -> identical files.
        env_class: the environment the rows name (``text2sql``: skyrl-gym's exact scorer).

    Returns ``{"train": path, "validation": path, "databases": folder}``; point
    ``environment.skyrl_gym.text2sql_lenient.db_root`` at the ``databases`` folder.
    """
    output_dir = Path(output_dir)
    db_dir = output_dir / "databases"
    db_path = build_shop_database(db_dir / f"{DB_ID}.sqlite")
    questions = _answerable(db_path, shop_questions())
    train, val = _split(questions, num_train, num_val, seed)
    system_prompt = SYSTEM_PROMPT.format(schema=read_schema(db_path))
    schema = arrow_schema(_extra_info_fields())
    written: dict[str, Path] = {}
    for split, split_questions in (("train", train), ("validation", val)):
        rows = [_row(question, system_prompt, split, i, env_class) for i, question in enumerate(split_questions)]
        written[split] = write_parquet(rows, output_dir / f"{split}.parquet", schema)
    written["databases"] = db_dir
    return written
