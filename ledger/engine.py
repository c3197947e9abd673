"""Engines for the ledger database: SQLite (embedded default) and PostgreSQL.

Fork safety: Celery's prefork pool forks children after the parent may have opened the
ledger. A pooled connection shared across ``fork()`` corrupts both sides' protocol state, so
the store builds its engine lazily and rebuilds it when it finds itself in a new process
(``StoreCore.engine`` in ``core.py``); here we only make engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

#: How long a SQLite writer waits for the lock before failing. Long, because claims from many
#: pool processes queue on one file lock; each holds it for well under a millisecond.
SQLITE_BUSY_TIMEOUT_MS = 30_000

#: Connect timeout for PostgreSQL. A claim that cannot reach the ledger must fail fast and
#: retry the task later, not hold a pool process for the kernel's TCP timeout.
PG_CONNECT_TIMEOUT_S = 5


#: Execution option marking a connection whose transaction only reads.
READ_ONLY = "ledger_read_only"


def normalize_url(url: str) -> str:
    """Map ``postgresql://`` and ``postgres://`` onto the psycopg 3 driver."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def parse_url(url: str) -> URL:
    """``url`` parsed (``postgresql://`` mapped onto psycopg 3).

    Raises:
        ValueError: in the ledger's words, when it is not a URL at all (SQLAlchemy's own words
            for ``postgresql://[::1`` are "invalid literal for int()"). The URL itself is not
            repeated: it may carry a password.
    """
    try:
        return make_url(normalize_url(url))
    except (ArgumentError, ValueError):
        raise ValueError(
            "the ledger URL cannot be parsed: give one like postgresql://user@host:5432/db "
            "or sqlite:///path/to/ledger.sqlite3 (a port must be a number, an IPv6 host "
            "is written [::1])"
        ) from None


def is_sqlite(url: str) -> bool:
    return parse_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for ``url`` with the ledger's connection settings applied."""
    parsed = parse_url(url)
    url = normalize_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, **kwargs)
        _configure_sqlite(engine)
        return engine
    if backend == "postgresql":
        connect_args = kwargs.pop("connect_args", {})
        connect_args.setdefault("connect_timeout", PG_CONNECT_TIMEOUT_S)
        connect_args.setdefault("application_name", "celery-ledger")
        kwargs.setdefault("pool_size", 2)
        kwargs.setdefault("max_overflow", 4)
        kwargs.setdefault("pool_pre_ping", False)
        return create_engine(url, connect_args=connect_args, **kwargs)
    raise ValueError(f"celery-ledger supports sqlite and postgresql URLs, not {backend!r}")


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module (it would BEGIN lazily, and
        # DEFERRED): every ledger transaction reads then writes, and a deferred reader that
        # tries to upgrade to a writer fails with SQLITE_BUSY at once, busy timeout or not.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        # FULL: a `started` intent row must survive power loss, not only a process crash.
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # IMMEDIATE takes the write lock up front, so concurrent claims queue on the busy
        # timeout instead of failing on lock upgrade. Read-only methods (operators, metrics)
        # ask for a plain deferred BEGIN: under WAL they never block a writer.
        if conn.get_execution_options().get(READ_ONLY):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
