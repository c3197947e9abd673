"""What a recovery sweep costs on a large ledger, and what it costs with nothing to do.

    python benchmarks/sweep.py                      # 1,000,000 settled rows, PostgreSQL + SQLite
    python benchmarks/sweep.py --rows 10000 --backend sqlite
    python benchmarks/sweep.py --rows 1000 --backend postgres --broker redis   # batched

The ledger (a scratch PostgreSQL database, or a temporary SQLite file) is bulk-loaded with
one ``INSERT ... SELECT`` over ``generate_series`` (PostgreSQL) or a recursive CTE (SQLite),
never through ``claim()``: settled entries (completed, settled within the retention window, so
there is nothing to prune) and 1,000 ``running`` entries (``--running``). A measurement
sets the leases of the first E running entries in the past (the rest stay live), then times
``recovery.run_sweep`` with a stub app that only records ``send_task``:

- ``no-op``: nothing expired, nothing interrupted (what every beat tick costs);
- ``E expired``: the sweep interrupts E entries, lists them and re-enqueues each one
  (``batch`` = E, so one sweep does it all); also the two queries alone
  (``interrupt_expired`` + ``list_interrupted``).

With ``--broker redis`` the re-sends go to Redis through a real Celery app (a queue of this
run's own, deleted after each sweep) instead of the stub, and each size is also swept the old
way, one entry at a time (``resume_entry`` per entry: a read, a CAS and a commit, a producer
per re-send), beside the batched sweep (design.md § "The sweep resumes
in batches").

Each figure is the median of ``--repeat`` sweeps, measured first with 1,000 settled rows and
then with ``--rows`` settled rows and the same running entries: the sweep should cost what the
expired entries cost, not what the settled ones do. On PostgreSQL the stale-lease statement's
plan is printed (``EXPLAIN ANALYZE`` inside a rolled-back transaction).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from common import REDIS_URL, Report, databases, exit_on_sigterm, format_rows, median
from sqlalchemy import event, text

from celery_ledger.ledger import LedgerStore
from celery_ledger.recovery import ResumeOutcome, resume_entry, run_sweep

BENCH = "sweep"
SMALL = 1000
SNAPSHOT = '{"args": [], "kwargs": {}, "queue": null, "ledger_key": null}'


class StubApp:
    """Records what the sweep would send to the broker."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        self.sent.append((name, options))


class RedisApp:
    """A real Celery app on Redis whose re-sends go to a queue of this run's own."""

    def __init__(self, url: str) -> None:
        import os

        from celery import Celery

        self.queue = f"ledger-sweep-bench-{os.getpid()}"
        self.app = Celery("sweep-bench", broker=url, set_as_current=False)
        self.app.conf.task_default_queue = self.queue
        self.app.conf.broker_connection_retry_on_startup = False

    def drain(self) -> int:
        """Delete the queue; returns how many messages it held."""
        with self.app.connection_for_write() as conn:
            client = conn.default_channel.client
            held = int(client.llen(self.queue))
            client.delete(self.queue)
            return held

    def close(self) -> None:
        self.drain()
        self.app.close()


def _now() -> float:
    return time.time()


def load_settled(store: LedgerStore, start: int, stop: int) -> None:
    """Insert settled entries ``start``..``stop`` (inclusive) in one statement."""
    if start > stop:
        return
    cols = (
        "key, task_name, task_id, status, fence, side_effect, args_hash, owner, owner_boot, "
        "owner_pid, result, executions, interruptions, created_at, updated_at, settled_at"
    )
    if store.is_sqlite:
        sql = (
            f"WITH RECURSIVE g(x) AS (SELECT :start UNION ALL SELECT x + 1 FROM g "
            f"WHERE x < :stop) INSERT INTO ledger_entries ({cols}) "
            "SELECT printf('s%063d', x), 'bench.settled', 's' || x, 'completed', 1, "
            "'non_idempotent', 'task-id', 'celery@bench', 'b', 1, 'null', 1, 0, "
            ":now - (x % 3600), :now - (x % 3600), :now - (x % 3600) FROM g"
        )
    else:
        sql = (
            f"INSERT INTO ledger_entries ({cols}) "
            "SELECT 's' || lpad(g::text, 63, '0'), 'bench.settled', 's' || g, 'completed', "
            "1, 'non_idempotent', 'task-id', 'celery@bench', 'b', 1, 'null', 1, 0, "
            ":now - (g % 3600), :now - (g % 3600), :now - (g % 3600) "
            "FROM generate_series(CAST(:start AS bigint), CAST(:stop AS bigint)) g"
        )
    with store.engine.begin() as conn:
        conn.execute(text(sql), {"start": start, "stop": stop, "now": _now()})


def load_running(store: LedgerStore, running: int) -> None:
    rows = [
        {"key": f"r{i:063d}", "task_id": f"r{i:06d}", "now": _now(), "snap": SNAPSHOT}
        for i in range(1, running + 1)
    ]
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO ledger_entries (key, task_name, task_id, status, fence, side_effect, "
                "args_hash, snapshot, owner, owner_boot, owner_pid, lease_until, executions, "
                "interruptions, created_at, updated_at) VALUES (:key, 'bench.running', :task_id, "
                "'running', 1, 'non_idempotent', 'task-id', :snap, 'celery@bench', 'b', 1, "
                ":now + 3600, 1, 0, :now, :now)"
            ),
            rows,
        )


def expire(store: LedgerStore, n: int) -> None:
    """Make the first ``n`` running entries expired and the rest live again."""
    now = _now()
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE ledger_entries SET status = 'running', owner = 'celery@bench', "
                "owner_boot = 'b', owner_pid = 1, interruptions = 0, reason = NULL, "
                "lease_until = CASE WHEN task_id <= :cut THEN :past ELSE :live END "
                "WHERE task_name = 'bench.running'"
            ),
            {"cut": f"r{n:06d}", "past": now - 60, "live": now + 3600},
        )


def analyze(store: LedgerStore) -> None:
    if store.is_sqlite:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE")
        return
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE ledger_entries")


def sweep_once(store: LedgerStore, batch: int, broker: RedisApp | None = None) -> tuple[float, Any]:
    app = StubApp() if broker is None else broker.app
    started = time.perf_counter()
    report = run_sweep(store, app, lease_seconds=60, max_resumes=5, retention_days=7, batch=batch)
    ms = (time.perf_counter() - started) * 1000
    if broker is not None and broker.drain() != report.resumed:
        raise RuntimeError("Redis does not hold every re-send the sweep counted")
    return ms, report


def sweep_one_by_one(store: LedgerStore, batch: int, broker: RedisApp) -> float:
    """The sweep before it resumed in batches: ``resume_entry`` for each entry (ms)."""
    started = time.perf_counter()
    store.interrupt_expired(limit=batch)
    resumed = sum(
        resume_entry(store, broker.app, e, lease_seconds=60, max_resumes=5) is ResumeOutcome.RESUMED
        for e in store.list_interrupted(limit=batch, resumable=True)
    )
    ms = (time.perf_counter() - started) * 1000
    if broker.drain() != resumed:
        raise RuntimeError("Redis does not hold every re-send the sweep counted")
    return ms


def measure(
    store: LedgerStore, expired: int, repeat: int, broker: RedisApp | None = None
) -> dict[str, float]:
    """Median ms of a full sweep and of its two queries, with ``expired`` stale leases."""
    full, queries, single = [], [], []
    batch = max(expired, 500)
    for _ in range(repeat):
        expire(store, expired)
        ms, report = sweep_once(store, batch, broker)
        if report.interrupted != expired or report.resumed != expired:
            raise RuntimeError(f"sweep did not do its work: {report.as_dict()}")
        full.append(ms)
        if broker is not None:
            expire(store, expired)
            single.append(sweep_one_by_one(store, batch, broker))
        expire(store, expired)
        started = time.perf_counter()
        store.interrupt_expired(limit=batch)
        store.list_interrupted(limit=batch)
        queries.append((time.perf_counter() - started) * 1000)
    expire(store, 0)
    got = {"full": median(full), "queries": median(queries)}
    if single:
        got["single"] = median(single)
    return got


def explain_stale(store: LedgerStore, expired: int) -> str:
    """The plan of ``interrupt_expired``'s statement, run and rolled back."""
    captured: list[tuple[str, Any]] = []

    def grab(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if "UPDATE ledger_entries" in statement and not captured:
            captured.append((statement, params))

    expire(store, expired)
    event.listen(store.engine, "before_cursor_execute", grab)
    try:
        store.interrupt_expired(limit=500)
    finally:
        event.remove(store.engine, "before_cursor_execute", grab)
    expire(store, expired)
    statement, params = captured[0]
    with store.engine.connect() as conn:
        plan = [
            r[0]
            for r in conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + statement, params
            )
        ]
        conn.rollback()
    expire(store, 0)
    return "\n".join(plan)


def run(
    backends: tuple[str, ...] = ("postgres", "sqlite"),
    rows: int = 1_000_000,
    repeat: int = 5,
    running: int = 1000,
    broker_url: str | None = None,
) -> Report:
    report = Report()
    broker = RedisApp(broker_url) if broker_url else None
    via = "" if broker is None else ", re-sent to Redis"
    small = min(SMALL, rows)
    with databases(list(backends)) as urls:
        for backend, url in urls.items():
            name = "PostgreSQL" if backend == "postgres" else "SQLite"
            store = LedgerStore(url)
            store.ensure_ready()
            load_settled(store, 1, small)
            load_running(store, running)
            analyze(store)
            sweep_once(store, 500)  # warm
            for settled in (small, rows):
                if settled == rows and rows > small:
                    started = time.perf_counter()
                    load_settled(store, small + 1, rows)
                    analyze(store)
                    print(
                        f"  {name}: loaded {rows:,} settled rows in "
                        f"{time.perf_counter() - started:.1f}s",
                        file=sys.stderr,
                    )
                elif settled == rows and settled != small:
                    continue
                size = f"{settled:,} settled"
                noop = []
                for _ in range(repeat):
                    ms, rep = sweep_once(store, 500)
                    if rep.interrupted or rep.found or rep.pruned:
                        raise RuntimeError(f"the no-op sweep did work: {rep.as_dict()}")
                    noop.append(ms)
                report.add(
                    BENCH,
                    f"no-op sweep, {size} ({name})",
                    median(noop),
                    "ms",
                    target="< 50" if backend == "postgres" else "",
                    note=f"median of {repeat}",
                )
                counts = (running // 10, running) if settled == rows else (running,)
                for expired in counts:
                    got = measure(store, expired, repeat, broker)
                    report.add(
                        BENCH,
                        f"sweep {expired:,} expired, {size} ({name}{via})",
                        got["full"],
                        "ms",
                        target="< 500" if broker is not None and expired == 1000 else "",
                        note="interrupt + list + re-enqueue in batches",
                    )
                    if "single" in got:
                        report.add(
                            BENCH,
                            f"sweep {expired:,} expired one entry at a time, {size} ({name}{via})",
                            got["single"],
                            "ms",
                            note="resume_entry per entry (before the batched sweep)",
                        )
                    report.add(
                        BENCH,
                        f"stale queries {expired:,} expired, {size} ({name})",
                        got["queries"],
                        "ms",
                        note="interrupt_expired + list_interrupted",
                    )
                if backend == "postgres" and settled == rows:
                    report.text[f"EXPLAIN stale-lease statement, {size}, nothing expired"] = (
                        explain_stale(store, 0)
                    )
                    report.text[
                        f"EXPLAIN stale-lease statement, {size}, "
                        f"{running // 2:,} of {running:,} running expired"
                    ] = explain_stale(store, running // 2)
            store.dispose()
    if broker is not None:
        broker.close()
    return report


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["postgres", "sqlite", "both"], default="both")
    parser.add_argument("--rows", type=int, default=1_000_000, help="settled entries")
    parser.add_argument(
        "--running",
        type=int,
        default=1000,
        help="running entries; a tenth and all of them expire in turn",
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--broker",
        choices=["stub", "redis"],
        default="stub",
        help="where re-sends go: a stub that records them, or Redis through a real Celery app",
    )
    args = parser.parse_args()
    backends = ("postgres", "sqlite") if args.backend == "both" else (args.backend,)
    broker_url = REDIS_URL if args.broker == "redis" else None
    report = run(backends, args.rows, args.repeat, args.running, broker_url)
    print(format_rows(report.rows))
    for title, plan in report.text.items():
        print(f"\n{title}:\n{plan}")


if __name__ == "__main__":
    main()
