"""What a metrics scrape costs with 100,000 entries in the ledger.

    python benchmarks/scrape.py                      # PostgreSQL scratch database on 127.0.0.1
    python benchmarks/scrape.py --backend sqlite     # a temporary SQLite file
    python benchmarks/scrape.py --entries 1000000 --steps-per-entry 3

Fills a scratch ledger (created here and dropped afterwards) with entries spread over ten
task names and every status (mostly completed, as a real ledger is), three replay rows each,
then measures:

- ``stats()``: one uncached computation of the aggregates (what a scrape costs at most once
  per ttl), median of ``--repeat`` runs;
- a scrape served from the collector's cache (what every other scrape costs);
- on PostgreSQL, the plans of the aggregate queries (``--explain``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from sqlalchemy import insert, text  # noqa: E402

from celery_ledger.ledger import LedgerStore  # noqa: E402
from celery_ledger.ledger.schema import entries, steps  # noqa: E402
from celery_ledger.metrics import LedgerCollector  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from common import exit_on_sigterm  # noqa: E402

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
TASKS = [f"shop.task_{i}" for i in range(10)]
#: Out of every 10,000 entries: the rest are completed.
MIX = {"running": 20, "interrupted": 2, "blocked": 3, "retrying": 5, "failed": 100}
CHUNK = 5000


def status_of(i: int) -> str:
    slot = i % 10_000
    for status, n in MIX.items():
        if slot < n:
            return status
        slot -= n
    return "completed"


def fill(store: LedgerStore, n: int, steps_per_entry: int) -> None:
    now = time.time()
    with store.engine.begin() as conn:
        for start in range(0, n, CHUNK):
            rows, step_rows = [], []
            for i in range(start, min(start + CHUNK, n)):
                status = status_of(i)
                key = f"{i:064x}"
                running = status == "running"
                rows.append(
                    {
                        "key": key,
                        "task_name": TASKS[i % len(TASKS)],
                        "task_id": str(i),
                        "status": status,
                        "fence": 1,
                        "side_effect": "non_idempotent",
                        "args_hash": "task-id",
                        "snapshot": None,
                        "owner": "celery@bench" if running else None,
                        "owner_boot": "b",
                        "owner_pid": 1,
                        # every other running entry has an expired lease
                        "lease_until": (now + (60 if i % 2 else -60)) if running else None,
                        "result": "1" if status == "completed" else None,
                        "executions": 1,
                        "interruptions": 1 if status == "interrupted" else 0,
                        "created_at": now - i,
                        "updated_at": now - i,
                        "settled_at": now - i if status in ("completed", "failed") else None,
                    }
                )
                for s in range(steps_per_entry):
                    step_rows.append(
                        {
                            "key": key,
                            "name": f"step{s}",
                            "input_hash": "h",
                            "occurrence": 0,
                            "seq": s,
                            "status": "completed",
                            "output": "1",
                            "fence": 1,
                            "attempts": 1,
                            "authorized": 0,
                            "started_at": now - i,
                            "completed_at": now - i,
                        }
                    )
            conn.execute(insert(entries), rows)
            if step_rows:
                conn.execute(insert(steps), step_rows)


def timed(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def explain(store: LedgerStore) -> None:
    # The statements stats() issues, as SQL, with EXPLAIN ANALYZE.
    queries = {
        "by task and status": "SELECT task_name, status, count(*) FROM ledger_entries "
        "GROUP BY task_name, status",
        "running, expired": "SELECT count(CASE WHEN lease_until < 0 THEN 1 END), "
        "max(updated_at) FROM ledger_entries WHERE status = 'running'",
        "interruptions": "SELECT coalesce(sum(interruptions), 0) FROM ledger_entries "
        "WHERE status IN ('interrupted', 'blocked', 'running')",
        "effect steps": "SELECT count(*), coalesce(sum(CASE WHEN attempts - 1 - authorized > 0 "
        "THEN attempts - 1 - authorized ELSE 0 END), 0) FROM ledger_steps "
        "WHERE status != 'not_executed'",
    }
    with store.engine.connect() as conn:
        for what, sql in queries.items():
            plan = [r[0] for r in conn.execute(text("EXPLAIN ANALYZE " + sql))]
            print(f"  {what}:")
            for line in plan:
                if "Scan" in line or "Execution Time" in line:
                    print(f"    {line.strip()}")


def run(url: str, args: argparse.Namespace) -> None:
    store = LedgerStore(url)
    started = time.perf_counter()
    fill(store, args.entries, args.steps_per_entry)
    if not store.is_sqlite:
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE ledger_entries"))
            conn.execute(text("VACUUM ANALYZE ledger_steps"))
    else:
        with store.engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE")
    print(
        f"filled {args.entries:,} entries and {args.entries * args.steps_per_entry:,} "
        f"replay rows in {time.perf_counter() - started:.1f}s ({store.engine.dialect.name})"
    )

    store.stats()  # warm the connection and the cache of the database
    cold = timed(store.stats, args.repeat)
    collector = LedgerCollector(store, ttl=3600)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    first = timed(lambda: generate_latest(registry), 1)[0]
    cached = timed(lambda: generate_latest(registry), 1000)
    stats = store.stats()
    print(
        f"aggregates: {dict(sorted(stats.by_status.items()))}, "
        f"expired {stats.expired_running}, entries {stats.entries:,}"
    )
    print(
        f"stats() uncached: median {statistics.median(cold) * 1000:.1f} ms, "
        f"max {max(cold) * 1000:.1f} ms over {args.repeat} runs"
    )
    print(
        f"scrape that recomputes: {first * 1000:.1f} ms; "
        f"scrape from the cache: median {statistics.median(cached) * 1e6:.0f} us "
        f"(collector computed {collector.computations} time(s) for 1,001 scrapes)"
    )
    if args.explain and not store.is_sqlite:
        explain(store)
    store.dispose()


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument(
        "--pg-admin",
        default=PG_ADMIN,
        help="PostgreSQL URL used to create and drop the scratch database",
    )
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--steps-per-entry", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--explain", action="store_true", help="print the query plans (PG)")
    args = parser.parse_args()
    if args.backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            run(f"sqlite:///{tmp}/ledger.sqlite3", args)
        return
    import psycopg

    name = f"cl_bench_{uuid.uuid4().hex[:10]}"
    admin = args.pg_admin.replace("+psycopg", "")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        run(f"{admin.rsplit('/', 1)[0]}/{name}", args)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
