"""The amortized floor: the ledger's claim and settle sent per task, against the same writes
batched by a worker's parent (docs/design.md § "The amortized ledger (designed, not built)").

    python benchmarks/batched_floor.py               # 4,000 tasks per mode, 3 rounds
    python benchmarks/batched_floor.py --tasks 64 --rounds 1 --json

None of the ledger's Python runs: raw SQL through one psycopg connection in autocommit, on a
schema of this run's own (``bf_amortized``: the ledger's entries and events tables with every
index they have at revision 0009), dropped afterwards. The SQL is the ledger's
(``ledger/statements.py`` compiled for PostgreSQL), the constants the hot path binds written in.
Each mode writes what a step-less task needs:

- ``per task`` (today, the default class): a claim of a new key (``INSERT … ON CONFLICT DO
  NOTHING`` with its ``claimed`` event; it waits for the flush: it is the body's intent), then
  a settle (``UPDATE`` with its ``settled`` event, not waited for). No lease renewal: a short
  task ends before its first one is due. ``per task, lazy``: the same for ``idempotent``,
  whose claim does not wait either.
- ``batched N``: N claims in one ``INSERT … SELECT FROM unnest(…)`` with their events (it
  waits for the flush), one lease renewal of the N (``UPDATE … FROM unnest(…)``, fenced per
  entry, not waited for), N settles in one ``UPDATE … FROM unnest(…)`` with their events (not
  waited for).

Per task: wall milliseconds, commits (``pg_stat_database.xact_commit``, less what the
measurement's own queries commit) and WAL bytes (``pg_current_wal_lsn()`` before and after).
Both counters are the server's: another session's commits in this database, or anyone's WAL,
count too. Run it on a quiet server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

#: One mode's writes for a list of fresh keys, on a cursor.
Write = Callable[[Any, list[str]], None]

URL = os.environ.get("CELERY_LEDGER_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
SCHEMA = "bf_amortized"
BATCHES = (1, 8, 32, 128)
#: Every mode starts from the same table: this many tasks first, not measured.
WARMUP = 200
NOW = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"
LAZY = "set_config('synchronous_commit', 'off', true)"
LEASE = 300.0
#: About the size of a sealed envelope of a task with two small arguments.
SNAPSHOT = json.dumps({"args": ["order-1", 42], "kwargs": {}, "queue": "celery", "v": "x" * 160})
SHARED = {"args_hash": "0" * 64, "snapshot": SNAPSHOT, "owner": "celery@bench", "lease": LEASE}

E = f"{SCHEMA}.ledger_entries"
DDL = f"""
CREATE SCHEMA {SCHEMA};
CREATE TABLE {E} (
    key VARCHAR(64) PRIMARY KEY, task_name VARCHAR(255) NOT NULL, task_id VARCHAR(255) NOT NULL,
    status VARCHAR(16) NOT NULL, fence BIGINT NOT NULL, side_effect VARCHAR(16) NOT NULL,
    args_hash VARCHAR(64) NOT NULL, snapshot TEXT, owner VARCHAR(255), owner_boot VARCHAR(64),
    owner_pid INTEGER, lease_until FLOAT, result TEXT, error TEXT, reason TEXT,
    executions INTEGER NOT NULL DEFAULT 0, interruptions INTEGER NOT NULL DEFAULT 0,
    created_at FLOAT NOT NULL, updated_at FLOAT NOT NULL, settled_at FLOAT,
    released_by VARCHAR(255), released_reason TEXT, released_at FLOAT,
    released_from VARCHAR(16), released_executions INTEGER, due_at FLOAT, dead_fence BIGINT,
    dead_by VARCHAR(255), dead_reason TEXT, dead_at FLOAT, seen_alive_at FLOAT,
    seen_alive_fence BIGINT, seen_alive_owner VARCHAR(255), cancel_requested_at FLOAT,
    cancel_by VARCHAR(255), cancel_reason TEXT, deadline_at FLOAT, tombstone_at FLOAT,
    group_id VARCHAR(255), parent_id VARCHAR(255), renewed_at FLOAT, lease_seconds FLOAT);
CREATE TABLE {SCHEMA}.ledger_events (
    id BIGSERIAL PRIMARY KEY, key VARCHAR(64) NOT NULL, task_id VARCHAR(255), fence BIGINT,
    event VARCHAR(32) NOT NULL, status VARCHAR(16), actor VARCHAR(255), detail TEXT,
    at FLOAT NOT NULL);
CREATE INDEX ON {E} (cancel_requested_at) WHERE cancel_requested_at IS NOT NULL
    AND status IN ('running', 'interrupted', 'retrying', 'scheduled', 'sleeping');
CREATE INDEX ON {E} (settled_at) WHERE settled_at IS NOT NULL;
CREATE INDEX ON {E} (task_name, status); CREATE INDEX ON {E} (task_id);
CREATE INDEX ON {E} (group_id) WHERE group_id IS NOT NULL;
CREATE INDEX ON {E} (parent_id) WHERE parent_id IS NOT NULL;
CREATE INDEX ON {E} (owner, owner_boot) WHERE status = 'running';
CREATE INDEX ON {E} (lease_until) WHERE status = 'running';
CREATE INDEX ON {E} (tombstone_at) WHERE tombstone_at IS NOT NULL;
CREATE INDEX ON {E} (status, updated_at) WHERE status IN ('interrupted', 'blocked', 'retrying');
CREATE INDEX ON {E} (due_at) WHERE due_at IS NOT NULL;
CREATE INDEX ON {SCHEMA}.ledger_events (key, id);
"""

_COLUMNS = (
    "key, task_name, task_id, status, fence, side_effect, args_hash, snapshot, owner,"
    " owner_boot, owner_pid, lease_until, executions, interruptions, created_at, updated_at,"
    " deadline_at, group_id, parent_id, renewed_at, lease_seconds"
)
_ROW = (
    "%(key)s, 'bench.noop', %(task_id)s, 'running', 1, 'non_idempotent', %(args_hash)s,"
    f" %(snapshot)s, %(owner)s, %(boot)s, %(pid)s, {NOW} + %(lease)s, 1, 0, {NOW}, {NOW},"
    f" NULL, NULL, NULL, {NOW}, %(lease)s"
)
_LOGGED = (
    f"logged AS (INSERT INTO {SCHEMA}.ledger_events (key, task_id, fence, event, status, actor,"
    f" detail, at) SELECT w.key, w.task_id, w.fence, %(event)s, w.status, %(owner)s, NULL, {NOW}"
    " FROM w)"
)
_SETTLED = (
    "status = 'completed', snapshot = coalesce(NULL, e.snapshot), lease_until = NULL,"
    f" result = {{result}}, error = NULL, reason = NULL, updated_at = {NOW}, settled_at = {NOW},"
    f" due_at = coalesce({NOW} + NULL, NULL),"
    " renewed_at = CASE WHEN e.interruptions > 0 THEN e.renewed_at END"
)
_RETURNED = "RETURNING e.key, e.task_id, e.fence, e.status"

CLAIM = (
    f"WITH w AS (INSERT INTO {E} AS e ({_COLUMNS}) VALUES ({_ROW})"
    f" ON CONFLICT (key) DO NOTHING {_RETURNED}, e.deadline_at, {NOW} AS now), {_LOGGED}"
    " SELECT w.key, w.task_id, w.fence, w.status FROM w"
)
CLAIM_LAZY = CLAIM.removesuffix(" FROM w") + f", {LAZY} FROM w"
SETTLE = (
    f"WITH w AS (UPDATE {E} AS e SET {_SETTLED.format(result='%(result)s')}"
    " WHERE e.key = %(key)s AND e.fence = %(fence)s AND e.status = 'running'"
    f" {_RETURNED}), {_LOGGED} SELECT w.key, {LAZY} FROM w"
)
_UNNEST_ROW = _ROW.replace("%(key)s", "u.key").replace("%(task_id)s", "u.task_id")
CLAIM_MANY = (
    "WITH u AS (SELECT * FROM unnest(%(keys)s::text[], %(task_ids)s::text[]) AS u(key, task_id)),"
    f" w AS (INSERT INTO {E} AS e ({_COLUMNS})"
    f" SELECT {_UNNEST_ROW} FROM u ON CONFLICT (key) DO NOTHING {_RETURNED}), {_LOGGED}"
    " SELECT w.key, w.fence FROM w"
)
RENEW_MANY = (
    f"UPDATE {E} AS e SET lease_until = {NOW} + %(lease)s,"
    f" renewed_at = {NOW}, lease_seconds = %(lease)s"
    " FROM unnest(%(keys)s::text[], %(fences)s::bigint[]) AS u(key, fence)"
    f" WHERE e.key = u.key AND e.fence = u.fence AND e.status = 'running' RETURNING {LAZY}"
)
SETTLE_MANY = (
    f"WITH w AS (UPDATE {E} AS e SET {_SETTLED.format(result='u.result')}"
    " FROM unnest(%(keys)s::text[], %(fences)s::bigint[], %(results)s::text[])"
    " AS u(key, fence, result) WHERE e.key = u.key AND e.fence = u.fence"
    f" AND e.status = 'running' {_RETURNED}), {_LOGGED} SELECT count(*), {LAZY} FROM w"
)


def task_values(n: int) -> list[str]:
    """``n`` fresh keys, each the size of the ledger's SHA-256 hex key."""
    return [uuid.uuid4().hex * 2 for _ in range(n)]


def constants() -> dict[str, Any]:
    """The values every task of a run shares (the ledger binds them per task)."""
    return {**SHARED, "boot": uuid.uuid4().hex, "pid": os.getpid()}


def per_task(lazy_claim: bool) -> Write:
    """Today: each task's claim and settle, each its own statement and commit. The claim of the
    default class waits for the flush (it is the body's intent); ``lazy_claim``: the claim of
    an ``idempotent`` task, which does not."""
    claim = CLAIM_LAZY if lazy_claim else CLAIM

    def run(cur: Any, keys: list[str]) -> None:
        const = constants()
        for key in keys:
            cur.execute(claim, {**const, "key": key, "task_id": key[:36], "event": "claimed"})
            fence = cur.fetchone()[2]
            settled = {**const, "key": key, "fence": fence, "result": "null", "event": "settled"}
            cur.execute(SETTLE, settled)
            cur.fetchall()

    return run


def batched(size: int) -> Write:
    """Batches of ``size``: one claim, one lease renewal and one settle statement each."""

    def run(cur: Any, keys: list[str]) -> None:
        const = constants()
        for start in range(0, len(keys), size):
            chunk = keys[start : start + size]
            cur.execute(
                CLAIM_MANY,
                {**const, "keys": chunk, "task_ids": [k[:36] for k in chunk], "event": "claimed"},
            )
            claimed = cur.fetchall()
            won = [str(k) for k, _ in claimed]
            fences = [int(f) for _, f in claimed]
            cur.execute(RENEW_MANY, {"keys": won, "fences": fences, "lease": LEASE})
            cur.fetchall()
            results = ["null"] * len(won)
            cur.execute(
                SETTLE_MANY,
                {**const, "keys": won, "fences": fences, "results": results, "event": "settled"},
            )
            cur.fetchall()

    return run


def counters(cur: Any) -> tuple[int, str]:
    """(commits of this database, the WAL position), after this backend's statistics are
    flushed (PostgreSQL 15 flushes them when the backend goes idle, at most once a second,
    unless told to flush at the next chance)."""
    cur.execute("SELECT pg_stat_force_next_flush()")
    cur.execute(
        "SELECT xact_commit, pg_current_wal_lsn()::text FROM pg_stat_database"
        " WHERE datname = current_database()"
    )
    commits, lsn = cur.fetchone()
    return int(commits), str(lsn)


def measured(cur: Any, write: Write, keys: list[str]) -> tuple[float, float, float]:
    """(wall s, commits, WAL bytes) of ``write`` over ``keys``."""
    commits0, lsn0 = counters(cur)
    t0 = time.perf_counter()
    write(cur, keys)
    wall = time.perf_counter() - t0
    cur.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (lsn0,))
    (wal,) = cur.fetchone()
    commits1, _ = counters(cur)
    return wall, float(commits1 - commits0), float(wal)


def one_round(cur: Any, write: Write, tasks: int) -> tuple[float, float, float]:
    """One mode from empty tables: a warm-up, then ``tasks`` tasks measured; per task."""
    cur.execute(f"TRUNCATE {SCHEMA}.ledger_entries, {SCHEMA}.ledger_events")
    write(cur, task_values(WARMUP))
    # What the measurement's own queries commit (its reads and flush requests), taken away.
    _, overhead, _ = measured(cur, lambda _cur, _keys: None, [])
    wall, commits, wal = measured(cur, write, task_values(tasks))
    return wall * 1000 / tasks, (commits - overhead) / tasks, wal / tasks


def measure(url: str, tasks: int, rounds: int) -> dict[str, dict[str, float]]:
    """Every mode on one connection, in a schema made for this run and dropped after it.

    The modes take turns, round after round, so that a change in the server's load falls on
    each of them. Wall time and commits: the median of the rounds; WAL: the least, since
    another session's WAL can only add to it.
    """
    modes: dict[str, Write] = {"per task": per_task(False), "per task, lazy": per_task(True)}
    modes.update({f"batched {n}": batched(n) for n in BATCHES})
    seen: dict[str, list[tuple[float, float, float]]] = {name: [] for name in modes}
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        cur.execute(DDL)
        try:
            for _ in range(rounds):
                for name, write in modes.items():
                    seen[name].append(one_round(cur, write, -(-tasks // rounds)))
        finally:
            cur.execute(f"DROP SCHEMA {SCHEMA} CASCADE")
    return {
        name: {
            "wall_ms": round(statistics.median(r[0] for r in runs), 4),
            "commits": round(statistics.median(r[1] for r in runs), 4),
            "wal_bytes": round(min(r[2] for r in runs), 1),
        }
        for name, runs in seen.items()
    }


def table(figures: dict[str, dict[str, float]]) -> str:
    """The figures as a fixed-width table, one row per mode."""
    lines = [f"{'mode':<14} | {'wall ms':>8} | {'commits':>7} | {'WAL bytes':>9} | vs per task"]
    base = figures["per task"]["wall_ms"]
    for name, row in figures.items():
        lines.append(
            f"{name:<14} | {row['wall_ms']:>8.4f} | {row['commits']:>7.3f} |"
            f" {row['wal_bytes']:>9.0f} | {row['wall_ms'] / base:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4000, help="tasks per mode (default 4000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, modes taking turns")
    parser.add_argument("--url", default=URL, help="PostgreSQL URL (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.rounds < 1:
        parser.error("--tasks and --rounds must be at least 1")
    figures = measure(args.url, args.tasks, args.rounds)
    if args.json:
        out = {"tasks": args.tasks, "rounds": args.rounds, "per_task": figures}
        print(json.dumps(out, indent=2))
    else:
        print(f"per task; {args.tasks} tasks per mode in {args.rounds} rounds; one connection")
        print(table(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
