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

from celery_ledger.ledger.forkgate import GATE

#: How long a SQLite writer waits for the lock before failing. Long, because claims from many
#: pool processes queue on one file lock; each holds it for well under a millisecond.
SQLITE_BUSY_TIMEOUT_MS = 30_000

#: Connect timeout for PostgreSQL. A claim that cannot reach the ledger must fail fast and
#: retry the task later, not hold a pool process for the kernel's TCP timeout.
PG_CONNECT_TIMEOUT_S = 5


#: ``application_name`` of the ledger's PostgreSQL connections, unless the URL gives one.
APPLICATION_NAME = "celery-ledger"

#: Execution option marking a connection whose transaction only reads.
READ_ONLY = "ledger_read_only"

#: The ledger URL's own query parameters (docs/operations.md § "Deploying"), read here and
#: removed before the URL reaches the driver. ``pooler=pgbouncer`` declares a transaction
#: pooler in front of PostgreSQL: prepared statements off, since psycopg names them per client
#: session and the pooler hands server sessions from client to client (PgBouncer before 1.21,
#: or with ``max_prepared_statements = 0``, answers ``prepared statement "_pg3_0" already
#: exists``). ``pooler=none`` says there is none. ``prepare_threshold=N`` (psycopg's meaning:
#: prepare a statement at its Nth execution; 0 at its first) or ``=none`` (never) overrides.
POOLER = "pooler"
POOLERS = ("pgbouncer", "none")
PREPARE_THRESHOLD = "prepare_threshold"


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


def parse_prepare_threshold(raw: str | int | None) -> int | None:
    """``prepare_threshold`` as psycopg takes it: a whole number >= 0, or None for never.

    Raises:
        ValueError: in the ledger's words, naming the values it takes.
    """
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "off")):
        return None
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = -1
    if value < 0 or isinstance(raw, bool):
        raise ValueError(
            f"prepare_threshold={raw!r} is not a whole number >= 0 or 'none' (none: never "
            "prepare, as a transaction pooler needs)"
        )
    return value


def driver_options(
    parsed: URL, prepare_threshold: str | int | None = None
) -> tuple[URL, dict[str, Any]]:
    """``parsed`` without the ledger's own query parameters, and the connect arguments they
    ask for: ``{"prepare_threshold": ...}`` when a pooler is declared or a threshold given
    (``prepare_threshold``, given to the store in code, wins over the URL's).

    Raises:
        ValueError: a value the ledger does not take, or one given on a SQLite URL.
    """
    query = dict(parsed.query)
    pooler = query.pop(POOLER, None)
    in_url = query.pop(PREPARE_THRESHOLD, None)
    if isinstance(pooler, tuple) or isinstance(in_url, tuple):
        raise ValueError("the ledger URL names pooler= or prepare_threshold= more than once")
    if (pooler is not None or in_url is not None) and parsed.get_backend_name() != "postgresql":
        raise ValueError("pooler= and prepare_threshold= apply to postgresql:// ledger URLs only")
    if pooler is not None and pooler.lower() not in POOLERS:
        raise ValueError(f"the ledger URL's pooler={pooler!r} is not one of: {', '.join(POOLERS)}")
    args: dict[str, Any] = {}
    if pooler is not None and pooler.lower() != "none":
        args[PREPARE_THRESHOLD] = None
    given = prepare_threshold if prepare_threshold is not None else in_url
    if given is not None:
        args[PREPARE_THRESHOLD] = parse_prepare_threshold(given)
    return parsed.set(query=query), args


def declared_pooler(url: str) -> str | None:
    """The ``pooler=`` a ledger URL declares (``none`` included), or None."""
    value = parse_url(url).query.get(POOLER)
    return value.lower() if isinstance(value, str) else None


def is_sqlite(url: str) -> bool:
    return parse_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, *, prepare_threshold: str | int | None = None, **kwargs: Any) -> Engine:
    """Create an engine for ``url`` with the ledger's connection settings applied
    (``prepare_threshold``: see ``driver_options``).

    Raises:
        ValueError: in the ledger's words, for a URL or option it cannot use.
    """
    parsed, options = driver_options(parse_url(url), prepare_threshold)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, **kwargs)
        _configure_sqlite(engine)
        return engine
    if backend == "postgresql":
        connect_args = {**options, **kwargs.pop("connect_args", {})}
        connect_args.setdefault("connect_timeout", PG_CONNECT_TIMEOUT_S)
        if "application_name" not in parsed.query:
            # The name operators count a fleet's connections by (docs/operations.md §
            # "Deploying"); one given in the URL names this worker's connections apart.
            connect_args.setdefault("application_name", APPLICATION_NAME)
        kwargs.setdefault("pool_size", 2)
        kwargs.setdefault("max_overflow", 4)
        kwargs.setdefault("pool_pre_ping", False)
        return create_engine(parsed, connect_args=connect_args, **kwargs)
    raise ValueError(f"celery-ledger supports sqlite and postgresql URLs, not {backend!r}")


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module (it would BEGIN lazily, and
        # DEFERRED): every ledger transaction reads then writes, and a deferred reader that
        # tries to upgrade to a writer fails with SQLITE_BUSY at once, busy timeout or not.
        dbapi_conn.isolation_level = None
        with GATE.held():  # switching to WAL takes a lock (forkgate)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            # FULL: a `started` intent row must survive power loss, not only a process crash.
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

    # A fork waits while a connection is checked out (``forkgate``): from checkout to checkin,
    # or to its detach (the hot path's connections, whose units hold the gate themselves).
    @event.listens_for(engine, "checkout")
    def _on_checkout(_dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        GATE.enter(record)

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_conn: Any, record: Any) -> None:
        GATE.leave(record)

    @event.listens_for(engine, "detach")
    def _on_detach(_dbapi_conn: Any, record: Any) -> None:
        GATE.leave(record)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # IMMEDIATE takes the write lock up front, so concurrent claims queue on the busy
        # timeout instead of failing on lock upgrade. Read-only methods (operators, metrics)
        # ask for a plain deferred BEGIN: under WAL they never block a writer.
        if conn.get_execution_options().get(READ_ONLY):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
