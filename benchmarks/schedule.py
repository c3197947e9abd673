"""What the sweep's durable-time pass costs with many entries held by the ledger (design.md
§ "Durable time").

    python benchmarks/schedule.py                         # PostgreSQL: 1,000,000 settled rows,
                                                          # 100,000 scheduled, 1,000 due
    python benchmarks/schedule.py --settled 10000 --scheduled 10000 --due 100 --backend sqlite

The ledger (a scratch database) is bulk-loaded, never through ``schedule()``: settled entries
(``benchmarks/sweep.py``'s loader) and ``--scheduled`` entries ``scheduled`` an hour ahead. A
measurement moves the due time of the first D scheduled entries into the past, then times
``recovery.run_sweep`` (a stub app records what it would send):

- ``nothing due``: the full sweep with every scheduled entry held and none due (what every beat
  tick costs); target < 50 ms on PostgreSQL, as the no-op sweep;
- ``D due``: the sweep finds D due entries on the due-time index, wakes each (compare-and-set)
  and sends it; also ``list_due`` alone. It should grow with D, not with the entries held: the
  same figures are taken with only 1,000 scheduled entries held, side by side.

Each figure is the median of ``--repeat`` sweeps. The plan of ``list_due``'s query is printed
(PostgreSQL).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from common import Report, databases, exit_on_sigterm, format_rows, median
from sqlalchemy import text
from sweep import SNAPSHOT, StubApp, analyze, load_settled

from celery_ledger.ledger import LedgerStore
from celery_ledger.recovery import run_sweep

BENCH = "schedule"


def load_scheduled(store: LedgerStore, start: int, stop: int) -> None:
    """Insert scheduled entries ``start``..``stop`` (inclusive), due in an hour."""
    cols = (
        "key, task_name, task_id, status, fence, side_effect, args_hash, snapshot, owner, "
        "executions, interruptions, created_at, updated_at, due_at"
    )
    if store.is_sqlite:
        sql = (
            f"WITH RECURSIVE g(x) AS (SELECT :start UNION ALL SELECT x + 1 FROM g "
            f"WHERE x < :stop) INSERT INTO ledger_entries ({cols}) "
            "SELECT printf('h%063d', x), 'bench.held', printf('h%08d', x), 'scheduled', 1, "
            "'non_idempotent', 'task-id', :snap, 'celery-ledger:resume', 0, 0, :now, :now, "
            ":now + 3600 + x FROM g"
        )
    else:
        sql = (
            f"INSERT INTO ledger_entries ({cols}) "
            "SELECT 'h' || lpad(g::text, 63, '0'), 'bench.held', 'h' || lpad(g::text, 8, '0'), "
            "'scheduled', 1, 'non_idempotent', 'task-id', :snap, 'celery-ledger:resume', 0, 0, "
            ":now, :now, :now + 3600 + g "
            "FROM generate_series(CAST(:start AS bigint), CAST(:stop AS bigint)) g"
        )
    with store.engine.begin() as conn:
        conn.execute(
            text(sql), {"start": start, "stop": stop, "now": time.time(), "snap": SNAPSHOT}
        )


def make_due(store: LedgerStore, due: int) -> None:
    """Every held entry scheduled again; the first ``due`` of them due a minute ago."""
    now = time.time()
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE ledger_entries SET status = 'scheduled', owner = 'celery-ledger:resume', "
                "lease_until = NULL, due_at = CASE WHEN task_id <= :cut THEN :past "
                "ELSE :later END WHERE task_name = 'bench.held' AND (status <> 'scheduled' "
                "OR due_at < :now OR task_id <= :cut)"
            ),
            {"cut": f"h{due:08d}", "past": now - 60, "later": now + 3600, "now": now},
        )


def sweep_ms(store: LedgerStore, batch: int) -> tuple[float, Any]:
    app = StubApp()
    started = time.perf_counter()
    report = run_sweep(store, app, lease_seconds=60, max_resumes=5, retention_days=7, batch=batch)
    return (time.perf_counter() - started) * 1000, report


def measure(store: LedgerStore, due: int, repeat: int) -> dict[str, float]:
    full, listing = [], []
    for _ in range(repeat):
        make_due(store, due)
        ms, report = sweep_ms(store, max(due, 500))
        if report.woken != due:
            raise RuntimeError(f"sweep woke {report.woken}, not {due}: {report.as_dict()}")
        full.append(ms)
        make_due(store, due)
        started = time.perf_counter()
        found = store.list_due(limit=max(due, 500))
        listing.append((time.perf_counter() - started) * 1000)
        if len(found) != due:
            raise RuntimeError(f"list_due found {len(found)}, not {due}")
    make_due(store, 0)
    return {"full": median(full), "list": median(listing)}


def explain_due(store: LedgerStore, limit: int) -> str:
    with store.engine.connect() as conn:
        plan = [
            r[0]
            for r in conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) SELECT key, task_name, task_id, fence, "
                "status, due_at FROM ledger_entries WHERE due_at < "
                "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION) "
                "AND status IN ('scheduled', 'sleeping') "
                f"ORDER BY due_at LIMIT {int(limit)}"
            )
        ]
    return "\n".join(plan)


def run(
    backends: tuple[str, ...] = ("postgres",),
    settled: int = 1_000_000,
    scheduled: int = 100_000,
    due: int = 1000,
    repeat: int = 5,
) -> Report:
    report = Report()
    small = min(1000, scheduled)
    with databases(list(backends)) as urls:
        for backend, url in urls.items():
            name = "PostgreSQL" if backend == "postgres" else "SQLite"
            store = LedgerStore(url)
            store.ensure_ready()
            started = time.perf_counter()
            load_settled(store, 1, settled)
            load_scheduled(store, 1, small)
            analyze(store)
            print(
                f"  {name}: loaded {settled:,} settled rows in "
                f"{time.perf_counter() - started:.1f}s",
                file=sys.stderr,
            )
            sweep_ms(store, 500)  # warm
            for held in (small, scheduled) if scheduled > small else (small,):
                if held != small:
                    load_scheduled(store, small + 1, held)
                    analyze(store)
                size = f"{held:,} scheduled, {settled:,} settled"
                noop = []
                for _ in range(repeat):
                    make_due(store, 0)
                    ms, rep = sweep_ms(store, 500)
                    if rep.due or rep.woken:
                        raise RuntimeError(f"the nothing-due sweep did work: {rep.as_dict()}")
                    noop.append(ms)
                report.add(
                    BENCH,
                    f"sweep, nothing due, {size} ({name})",
                    median(noop),
                    "ms",
                    target="< 50" if backend == "postgres" else "",
                    note=f"median of {repeat}",
                )
                for d in sorted({max(due // 10, 1), due}):
                    got = measure(store, d, repeat)
                    report.add(
                        BENCH,
                        f"sweep {d:,} due, {size} ({name})",
                        got["full"],
                        "ms",
                        note="list + wake (CAS) + send each",
                    )
                    report.add(
                        BENCH,
                        f"list_due {d:,} due, {size} ({name})",
                        got["list"],
                        "ms",
                        note="the due-time index range",
                    )
                if held == scheduled and backend == "postgres":
                    make_due(store, 0)
                    report.text[f"EXPLAIN list_due, {size}, nothing due"] = explain_due(store, 500)
                    make_due(store, due)
                    report.text[f"EXPLAIN list_due, {size}, {due:,} due"] = explain_due(
                        store, max(due, 500)
                    )
                    make_due(store, 0)
            store.dispose()
    return report


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["postgres", "sqlite", "both"], default="postgres")
    parser.add_argument("--settled", type=int, default=1_000_000)
    parser.add_argument("--scheduled", type=int, default=100_000)
    parser.add_argument("--due", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    backends = ("postgres", "sqlite") if args.backend == "both" else (args.backend,)
    report = run(backends, args.settled, args.scheduled, args.due, args.repeat)
    print(format_rows(report.rows))
    for title, plan in report.text.items():
        print(f"\n{title}:\n{plan}")


if __name__ == "__main__":
    main()
