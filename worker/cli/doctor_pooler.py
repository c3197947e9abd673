"""``doctor``'s ``pooler`` check: is a connection pooler (PgBouncer) between the ledger and
PostgreSQL, and is the ledger told so (docs/operations.md § "Deploying")?

The signal: at start-up PostgreSQL tells a client the process id of its session (the
BackendKeyData message, which cancel requests quote); a pooler answers the start-up itself and
makes up a key of its own, since it must route a cancel to whichever server session is busy
for that client. So a connection whose start-up process id is not ``pg_backend_pid()`` did not
reach PostgreSQL directly. A plain TCP proxy passes the message through unchanged, and is
rightly not reported. Measured against PgBouncer 1.18: the start-up id is a random number,
negative as often as not.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import exc as sa_exc

from celery_ledger.ledger.engine import (
    PREPARE_THRESHOLD,
    declared_pooler,
    driver_options,
    is_sqlite,
    make_engine,
    parse_url,
)
from celery_ledger.view import one_line

#: What a transaction pooler needs, in one line.
ADVICE = "add ?pooler=pgbouncer to the ledger URL (ledger_url)"


def check_pooler(url: str) -> tuple[str, str, str]:
    """(name, PASS | WARN | FAIL, why): whether a pooler answers at ``url`` and whether
    prepared statements are off for it. Read-only: one connection, one query."""
    try:
        if is_sqlite(url):
            return ("pooler", "PASS", "SQLite: no connection pooler")
        _url, options = driver_options(parse_url(url))
    except ValueError as exc:
        return ("pooler", "FAIL", one_line(exc))
    prepares = options.get(PREPARE_THRESHOLD, 5) is not None
    try:
        pooled, startup_pid, backend_pid = _answered_by_pooler(url)
    except sa_exc.SQLAlchemyError:  # the schema check says why, in its line
        return ("pooler", "WARN", "not checked: the ledger is unreachable (see schema)")
    if pooled and prepares and PREPARE_THRESHOLD in parse_url(url).query:
        return (
            "pooler",
            "WARN",
            f"a connection pooler answers at this URL and prepare_threshold="
            f"{options[PREPARE_THRESHOLD]} keeps prepared statements on: only a PgBouncer 1.21 or "
            "later with max_prepared_statements > 0 takes them",
        )
    if pooled and prepares:
        return (
            "pooler",
            "FAIL",
            f"a connection pooler (PgBouncer?) answers at this URL (start-up pid {startup_pid}, "
            f"session pid {backend_pid}) and prepared statements are on: {ADVICE}",
        )
    if pooled:
        return ("pooler", "PASS", "behind a connection pooler; prepared statements off")
    if declared_pooler(url) == "pgbouncer":
        return (
            "pooler",
            "PASS",
            "pooler=pgbouncer declared but none seen (direct to PostgreSQL): statements are "
            "not prepared",
        )
    return ("pooler", "PASS", "direct to PostgreSQL (no connection pooler in between)")


def _answered_by_pooler(url: str) -> tuple[bool, int, int]:
    """(pooled, start-up pid, session pid) of one fresh connection to ``url``.

    Raises:
        SQLAlchemyError: the ledger cannot be reached (the driver's error, wrapped).
    """
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            dbapi: Any = conn.connection.dbapi_connection
            startup_pid = int(dbapi.info.backend_pid)
            backend_pid = int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
    finally:
        engine.dispose()
    return startup_pid != backend_pid, startup_pid, backend_pid
