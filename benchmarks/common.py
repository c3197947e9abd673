"""Shared plumbing of the benchmarks: scratch databases, statement counting, worker processes
(``celery_ledger.harness.processes``, the harness ``demo``, ``verify`` and the tests use).

Every benchmark returns ``Row``s (one figure each) so that ``benchmarks/run.py`` can print them
in one table and write ``docs/benchmarks.md``. Figures are measurements, never assertions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

from sqlalchemy import Engine, event  # noqa: E402

from celery_ledger.harness.processes import Process, ProcessGroup  # noqa: E402

log = logging.getLogger(__name__)

PG_ADMIN = os.environ.get("CELERY_LEDGER_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
#: Redis database 0 is never flushed here: the benchmarks use queue names and task ids of
#: their own and delete exactly the keys they created (the tests flush databases 1-15).
REDIS_URL = os.environ.get("CELERY_LEDGER_BENCH_REDIS", "redis://127.0.0.1:6379/0")


@dataclass(frozen=True)
class Row:
    """One figure of one benchmark."""

    bench: str
    metric: str
    value: float
    unit: str
    target: str = ""
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    """What a benchmark measured: its rows, and free text (plans, profiles) for the docs."""

    rows: list[Row] = field(default_factory=list)
    text: dict[str, str] = field(default_factory=dict)

    def add(self, *args: Any, **kwargs: Any) -> None:
        self.rows.append(Row(*args, **kwargs))

    def extend(self, other: Report) -> None:
        self.rows.extend(other.rows)
        self.text.update(other.text)


def format_rows(rows: list[Row]) -> str:
    """A fixed-width table: benchmark | metric | value | unit | target."""
    header = ("benchmark", "metric", "value", "unit", "target")
    body = [(r.bench, r.metric, fmt(r.value), r.unit, r.target) for r in rows]
    widths = [max(len(str(x[i])) for x in [header, *body]) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def fmt(value: float) -> str:
    if value == int(value) and abs(value) >= 100:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if value else "0"


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def per_task_ms(run: Callable[[int], Any], tasks: int, *, warmup: int) -> tuple[float, float]:
    """(CPU, wall) milliseconds per call of ``run(i)`` in this process over ``tasks`` calls,
    after ``warmup`` calls that are not timed (prepared statements, caches)."""
    for i in range(warmup):
        run(i)
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(tasks):
        run(i)
    return (
        (time.process_time() - cpu) / tasks * 1e3,
        (time.perf_counter() - wall) / tasks * 1e3,
    )


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# -- scratch databases ---------------------------------------------------------------------


@contextmanager
def pg_database(admin_url: str = PG_ADMIN) -> Iterator[str]:
    """A PostgreSQL database of this run's own, dropped afterwards; yields its URL."""
    import psycopg

    admin = admin_url.replace("+psycopg", "")
    name = f"cl_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{admin.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def sqlite_database() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="cl_bench_") as tmp:
        yield f"sqlite:///{tmp}/ledger.sqlite3"


@contextmanager
def databases(backends: list[str]) -> Iterator[dict[str, str]]:
    """One scratch ledger URL per backend name (``postgres``, ``sqlite``)."""
    with contextlib.ExitStack() as stack:
        urls = {}
        for backend in backends:
            cm = pg_database() if backend == "postgres" else sqlite_database()
            urls[backend] = stack.enter_context(cm)
        yield urls


def pg_stat(url: str, admin_url: str = PG_ADMIN) -> dict[str, int]:
    """Cumulative counters of one database from pg_stat_database (read from another db)."""
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(admin_url.replace("+psycopg", ""), autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted "
            "FROM pg_stat_database WHERE datname = %s",
            (name,),
        ).fetchone()
    assert row is not None
    return dict(zip(["commit", "rollback", "inserted", "updated", "deleted"], row, strict=True))


# -- counting statements -------------------------------------------------------------------


class StatementCounter:
    """Counts the statements an engine sends (``before_cursor_execute``) and its transactions.

    Each statement is one round trip to the database; on PostgreSQL a ``begin`` of a
    non-autocommit transaction adds one (psycopg sends BEGIN on its own) and its commit another.
    """

    def __init__(self, engine: Engine, fast: Any = None) -> None:
        self.engine = engine
        #: The store's hot path (``celery_ledger.ledger.fastpath.FastPath``), which bypasses
        #: engine events.
        self.fast = fast
        self.statements: list[str] = []
        self.begins = 0
        self.commits = 0

    def _on_fast(self, sql: str) -> None:
        head = sql.split(None, 1)[0].upper()
        if head == "BEGIN":
            self.begins += 1
        elif head == "COMMIT":
            self.commits += 1
        elif head != "ROLLBACK":
            self.statements.append(sql)

    def _on_execute(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        self.statements.append(statement)

    def _on_begin(self, conn: Any) -> None:
        if not _autocommit(conn):
            self.begins += 1

    def _on_commit(self, conn: Any) -> None:
        if not _autocommit(conn):
            self.commits += 1

    def __enter__(self) -> StatementCounter:
        event.listen(self.engine, "before_cursor_execute", self._on_execute)
        event.listen(self.engine, "begin", self._on_begin)
        event.listen(self.engine, "commit", self._on_commit)
        if self.fast is not None:
            self.fast.listeners.append(self._on_fast)
        return self

    def __exit__(self, *exc: Any) -> None:
        event.remove(self.engine, "before_cursor_execute", self._on_execute)
        event.remove(self.engine, "begin", self._on_begin)
        event.remove(self.engine, "commit", self._on_commit)
        if self.fast is not None:
            self.fast.listeners.remove(self._on_fast)

    def reset(self) -> None:
        self.statements.clear()
        self.begins = self.commits = 0

    @property
    def count(self) -> int:
        return len(self.statements)

    def writes(self) -> int:
        """Statements that modify data (INSERT/UPDATE/DELETE, including CTEs that do)."""
        return sum(1 for s in self.statements if _is_write(s))

    def touching(self, table: str) -> int:
        return sum(1 for s in self.statements if table in s)


def _autocommit(conn: Any) -> bool:
    # From the execution options, not get_isolation_level(): that one may ask the server.
    return conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"


def _is_write(sql: str) -> bool:
    head = sql.lstrip().upper()
    if head.startswith(("INSERT", "UPDATE", "DELETE")):
        return True
    return head.startswith("WITH") and any(w in head for w in ("INSERT ", "UPDATE ", "DELETE "))


# -- worker processes ----------------------------------------------------------------------


@contextmanager
def bench_worker(
    env: dict[str, str], log_dir: Path, name: str, *, concurrency: int = 2
) -> Iterator[Process]:
    """One ``celery -A bench_app worker`` on ``env["BENCH_QUEUE"]``, logging to
    ``log_dir/<name>.log``, stopped (its whole session) whatever happens.

    Logging at ``warning``: an ``info`` line per task would be part of what is measured.
    """
    group = ProcessGroup(
        log_dir,
        app="bench_app",
        env=env,
        cwd=BENCH,
        pythonpath=[BENCH],
        # A worker that drained thousands of tasks may take a while over its warm shutdown.
        stop_timeout=15.0,
    )
    with group:
        yield group.worker(
            name,
            queue=env["BENCH_QUEUE"],
            node=f"bench-{uuid.uuid4().hex[:6]}@%h",
            concurrency=concurrency,
            loglevel="warning",
        )


def memory_of(pid: int) -> dict[str, int]:
    """RSS, PSS and USS of one process in KiB (``/proc/<pid>/smaps_rollup``).

    USS (private clean + private dirty) is what one more pool process costs: pages shared
    copy-on-write with the parent (modules imported before the fork) are not in it.
    """
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss", "Private_Dirty", "Private_Clean", "Shared_Clean"):
            out[name.lower()] = int(rest.split()[0])
    out["uss"] = out.get("private_clean", 0) + out.get("private_dirty", 0)
    return out


# -- CPU per task, by process group ----------------------------------------------------------

_HZ = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> tuple[str, int, int, float] | None:
    """(command name, parent pid, session id, user + system CPU seconds) of one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    rest = stat[stat.rindex(")") + 2 :].split()
    return name, int(rest[1]), int(rest[3]), (int(rest[11]) + int(rest[12])) / _HZ


class CpuTally:
    """CPU seconds spent between ``start()`` and ``stop()`` by the worker's parent, the rest of
    its session (the pool processes), the PostgreSQL server processes and Redis, read from
    ``/proc/<pid>/stat``.

    A process that starts after ``start()`` counts from zero; one that exits before ``stop()``
    is not counted (the worker, its pool and its database connections all live through the
    drain, which is what this measures).
    """

    GROUPS = ("parent", "pool", "postgres", "redis")

    def __init__(self, worker_session: int) -> None:
        self.session = worker_session
        self._start: dict[int, float] = {}

    def _group(self, pid: int, name: str, session: int) -> str | None:
        if session == self.session:
            return "parent" if pid == self.session else "pool"
        if name == "postgres":
            return "postgres"
        if name.startswith("redis-server"):
            return "redis"
        return None

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        out = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                found = _cpu_seconds(int(entry))
                if found is not None:
                    group = self._group(int(entry), found[0], found[2])
                    if group is not None:
                        out[int(entry)] = (group, found[3])
        return out

    def start(self) -> None:
        self._start = {pid: cpu for pid, (_, cpu) in self._snapshot().items()}

    def stop(self) -> dict[str, float]:
        totals = dict.fromkeys(self.GROUPS, 0.0)
        for pid, (group, cpu) in self._snapshot().items():
            totals[group] += cpu - self._start.get(pid, 0.0)
        return totals


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so that ``finally`` and ``with`` blocks run: a benchmark
    stopped by ``kill`` still stops its workers and drops its scratch databases."""

    def _exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
