"""What the ledger's schema costs per task, part by part (docs/benchmarks.md
§ "The schema's floor"): its secondary indexes, the
audit event in each statement, and the rest of its row.

    python benchmarks/schema_cost.py                 # 4,000 tasks per case, median of 3 rounds
    python benchmarks/schema_cost.py --tasks 300 --rounds 1

One process, one bare psycopg connection in autocommit with every commit asynchronous, one
scratch PostgreSQL database migrated to the ledger's schema. Each case makes the two writes of
a task (a claim of a new key, then its settle) and no more:

- ``floor``: ``bench_app``'s two-write floor (a one-column row, its primary key);
- ``schema``: the ledger's own claim and settle statements with their audit events
  (``bench_app.ledger_statements``, the ``floor-ledger-sql`` variants' statements);
- ``schema, no event``: the same two writes without the event each appends (the entries
  statement alone, cut out of its CTE).

Each case runs three times over: with every index of the schema, with the five indexes a claim
and a settle of an entry that completes at once write to dropped (``task_status``, ``task_id``,
``running_owner``, ``running_lease``, events ``key``), then with every secondary index dropped.
The differences are what each part of the schema costs a task in wall time (the server's work:
CPU that a saturated worker host does not have).

The indexes are not optional: every sweep, operator query and page reads by one of them ("no
scans", ``docs/design.md``). This measures what a design that wanted them elsewhere would win.

    python benchmarks/schema_cost.py --events-pk     # the events' primary key on (key, id)
    python benchmarks/schema_cost.py --narrow-row    # the entries without their rare columns

``--events-pk`` measures the one change to the schema's indexes that keeps every reader: the
events' primary key on ``(key, id)`` instead of ``id`` (no query reads an event by ``id``
alone), so that each event feeds one index instead of two. The ``schema`` case on two scratch
databases, one as migrated and one with that key (its ``ix_ledger_events_key`` dropped),
rounds alternating between them.

``--narrow-row`` measures the other change the contract allows: a narrow hot row. The
entries table is rebuilt without the columns a claim and a settle never write (release,
mark-dead, seen-alive, cancellation, deadline and tombstone stamps; a design that wanted
this would keep them in a side table written only on those paths), against the table as
migrated, rounds alternating the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Report, format_rows, median, per_task_ms, pg_database

#: Every connection of this run commits without waiting for the flush (``measure`` sets it
#: before any connection opens; libpq reads it at connect).
ASYNC_COMMITS = "-c synchronous_commit=off"

WARMUP = 300
HOT_INDEXES = (
    "ix_ledger_entries_task_status",
    "ix_ledger_entries_task_id",
    "ix_ledger_entries_running_owner",
    "ix_ledger_entries_running_lease",
    "ix_ledger_events_key",
)
STAGES = ("every index", "five hot-path indexes dropped", "every secondary index dropped")


def cases(url: str) -> dict[str, Callable[[Any, int], None]]:
    import bench_app

    claim_row, settle_row, _folded = bench_app.ledger_statements(
        url.replace("postgresql://", "postgresql+psycopg://", 1)
    )

    def floor(cur: Any, i: int) -> None:
        task_id = str(uuid.uuid4())
        cur.execute(bench_app.FLOOR_CLAIM, (task_id,), prepare=True)
        cur.execute(bench_app.FLOOR_SETTLE, (task_id,), prepare=True)

    def schema(cur: Any, i: int) -> None:
        key = uuid.uuid4().hex * 2  # 64 characters, as an entry key
        sql, params = claim_row(key, "schema@bench", [i])
        cur.execute(sql, params, prepare=True)
        cur.fetchall()
        sql, params = settle_row(key, str(i), "schema@bench")
        cur.execute(sql, params, prepare=True)
        cur.fetchall()

    def schema_no_event(cur: Any, i: int) -> None:
        key = uuid.uuid4().hex * 2
        sql, params = claim_row(key, "schema@bench", [i])
        cur.execute(bench_app.without_event(sql), params, prepare=True)
        sql, params = settle_row(key, str(i), "schema@bench")
        cur.execute(bench_app.without_event(sql), params, prepare=True)

    return {"floor": floor, "schema": schema, "schema, no event": schema_no_event}


def prepare(url: str) -> None:
    """Migrate a scratch database to the ledger's schema and add the floor's table."""
    import bench_app

    from celery_ledger.ledger import LedgerStore

    store = LedgerStore(url.replace("postgresql://", "postgresql+psycopg://", 1))
    store.ensure_ready()
    store.dispose()
    bench_app.create_floor_table(url)


def measure(tasks: int, rounds: int) -> Report:
    import psycopg

    os.environ["PGOPTIONS"] = ASYNC_COMMITS

    report = Report()
    with pg_database() as url:
        prepare(url)
        runs = cases(url)
        with psycopg.connect(url, autocommit=True) as conn:
            cur = conn.cursor()
            figures: dict[tuple[str, str], float] = {}
            for stage in STAGES:
                if stage == STAGES[1]:
                    for name in HOT_INDEXES:
                        conn.execute(f"DROP INDEX {name}")
                elif stage == STAGES[2]:
                    for (name,) in conn.execute(
                        "SELECT indexname FROM pg_indexes WHERE tablename IN"
                        " ('ledger_entries', 'ledger_events') AND indexname NOT LIKE '%pkey'"
                    ).fetchall():
                        conn.execute(f'DROP INDEX "{name}"')
                for case, fn in runs.items():
                    value = median(
                        [
                            per_task_ms(lambda i, fn=fn: fn(cur, i), tasks, warmup=WARMUP)[1]
                            for _ in range(rounds)
                        ]
                    )
                    figures[(stage, case)] = value
                    report.add("schema_cost", f"{case}, {stage}", value, "ms wall")
    full = figures[(STAGES[0], "schema")]
    report.add("schema_cost", "schema over floor", full - figures[(STAGES[0], "floor")], "ms wall")
    report.add(
        "schema_cost",
        "the events (schema minus schema, no event)",
        full - figures[(STAGES[0], "schema, no event")],
        "ms wall",
    )
    report.add(
        "schema_cost",
        "the secondary indexes (every index minus none)",
        full - figures[(STAGES[2], "schema")],
        "ms wall",
    )
    report.add(
        "schema_cost",
        "the row without indexes or events, over the floor",
        figures[(STAGES[2], "schema, no event")] - figures[(STAGES[2], "floor")],
        "ms wall",
    )
    return report


#: The events' primary key on (key, id): the key index's columns, so that index goes.
EVENTS_KEY_PK = (
    "ALTER TABLE ledger_events DROP CONSTRAINT ledger_events_pkey",
    "ALTER TABLE ledger_events ADD CONSTRAINT ledger_events_pkey PRIMARY KEY (key, id)",
    "DROP INDEX ix_ledger_events_key",
)


def rebuild_events_pk(conn: Any) -> None:
    for ddl in EVENTS_KEY_PK:
        conn.execute(ddl)


#: The entry columns that a claim and a settle never write: the release, mark-dead, seen-alive,
#: cancellation and tombstone stamps. A narrow hot row would keep them in a side table keyed by
#: the entry, written only on those rare paths. (The deadline is not one of them: the claim
#: stores it, for the admission gate.)
RARE_COLUMNS = (
    "released_by",
    "released_reason",
    "released_at",
    "released_from",
    "released_executions",
    "dead_fence",
    "dead_by",
    "dead_reason",
    "dead_at",
    "seen_alive_at",
    "seen_alive_fence",
    "seen_alive_owner",
    "cancel_requested_at",
    "cancel_by",
    "cancel_reason",
    "tombstone_at",
)


def narrow_entries(conn: Any) -> None:
    """Rebuild ``ledger_entries`` without :data:`RARE_COLUMNS` (a new table, so that no dropped
    column stays in its rows), with its primary key and every index that names none of them
    (the two that do would live on the side table)."""
    import re

    from celery_ledger.ledger.schema import entries

    rare = re.compile(r"\b(" + "|".join(RARE_COLUMNS) + r")\b")
    kept = [c.name for c in entries.columns if c.name not in RARE_COLUMNS]
    missing = set(RARE_COLUMNS) - {c.name for c in entries.columns}
    if missing:
        raise SystemExit(f"schema_cost: the entries table has no column {sorted(missing)}")
    indexes = [
        d
        for (d,) in conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE tablename = 'ledger_entries'"
            " AND indexname <> 'ledger_entries_pkey'"
        ).fetchall()
    ]
    conn.execute(
        f"CREATE TABLE ledger_entries_narrow AS SELECT {', '.join(kept)}"
        " FROM ledger_entries WITH NO DATA"
    )
    conn.execute("DROP TABLE ledger_entries CASCADE")
    conn.execute("ALTER TABLE ledger_entries_narrow RENAME TO ledger_entries")
    conn.execute("ALTER TABLE ledger_entries ADD PRIMARY KEY (key)")
    for ddl in indexes:
        if not rare.search(ddl):
            conn.execute(ddl)


#: ``--events-pk`` and ``--narrow-row``: the schema as migrated against one change to it.
LAYOUTS: dict[str, tuple[tuple[str, str], Callable[[Any], None], str]] = {
    "events-pk": (
        ("events primary key id, index (key, id)", "events primary key (key, id)"),
        rebuild_events_pk,
        "events primary key (key, id) saves",
    ),
    "narrow-row": (
        ("entries as migrated", "entries without the rare columns"),
        narrow_entries,
        "a narrow hot row saves",
    ),
}


def measure_layouts(which: str, tasks: int, rounds: int) -> Report:
    """The ``schema`` case on two scratch databases, one as migrated and one changed by
    ``LAYOUTS[which]``, rounds alternating between them."""
    import psycopg

    os.environ["PGOPTIONS"] = ASYNC_COMMITS
    report = Report()
    layouts, change, saves = LAYOUTS[which]
    with pg_database() as as_migrated, pg_database() as changed:
        runs: dict[str, tuple[Any, Callable[[Any, int], None]]] = {}
        with contextlib.ExitStack() as stack:
            for layout, url in zip(layouts, (as_migrated, changed), strict=True):
                prepare(url)
                conn = stack.enter_context(psycopg.connect(url, autocommit=True))
                if url == changed:
                    change(conn)
                runs[layout] = (conn.cursor(), cases(url)["schema"])
            got: dict[str, list[float]] = {layout: [] for layout in layouts}
            for r in range(rounds):
                for layout in layouts if r % 2 == 0 else layouts[::-1]:
                    cur, fn = runs[layout]
                    got[layout].append(
                        per_task_ms(lambda i, cur=cur, fn=fn: fn(cur, i), tasks, warmup=WARMUP)[1]
                    )
    for layout in layouts:
        report.add("schema_cost", f"schema, {layout}", median(got[layout]), "ms wall")
    report.add("schema_cost", saves, median(got[layouts[0]]) - median(got[layouts[1]]), "ms wall")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4_000)
    parser.add_argument("--rounds", type=int, default=3)
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument(
        "--events-pk",
        action="store_true",
        help="compare the events' primary key on id (as migrated) with one on (key, id)",
    )
    layout.add_argument(
        "--narrow-row",
        action="store_true",
        help="compare the entries table as migrated with one without the rare columns",
    )
    opts = parser.parse_args()
    if opts.events_pk or opts.narrow_row:
        which = "events-pk" if opts.events_pk else "narrow-row"
        report = measure_layouts(which, opts.tasks, opts.rounds)
    else:
        report = measure(opts.tasks, opts.rounds)
    print(format_rows(report.rows))


if __name__ == "__main__":
    main()
