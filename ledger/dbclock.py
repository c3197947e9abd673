"""The database clock, as one SQL expression per dialect.

Leases are computed and compared on the database's clock, never a worker's: two workers whose
clocks disagree by a minute still agree on whether a lease expired.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Float
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement


class db_now(FunctionElement[float]):  # noqa: N801 - reads as a SQL function
    """Seconds since the epoch, as a float, on the database server's clock."""

    type = Float()
    inherit_cache = True


@compiles(db_now, "postgresql")
def _pg_now(element: Any, compiler: Any, **kw: Any) -> str:
    # clock_timestamp(), not now(): now() is frozen at transaction start.
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


@compiles(db_now, "sqlite")
def _sqlite_now(element: Any, compiler: Any, **kw: Any) -> str:
    # julianday('now') has millisecond resolution; CURRENT_TIMESTAMP only seconds.
    return "((julianday('now') - 2440587.5) * 86400.0)"


@compiles(db_now)
def _default_now(element: Any, compiler: Any, **kw: Any) -> str:  # pragma: no cover
    raise NotImplementedError("celery-ledger supports SQLite and PostgreSQL")


class db_now_stable(FunctionElement[float]):  # noqa: N801 - reads as a SQL function
    """The database clock as of the start of the statement, for predicates.

    PostgreSQL treats ``clock_timestamp()`` as volatile and re-evaluates it per row, so
    ``lease_until < clock_timestamp()`` cannot bound an index scan: the stale-lease and
    retention queries would read every row of their index. ``statement_timestamp()`` is
    stable within the statement, so the planner turns the comparison into an index range.
    """

    type = Float()
    inherit_cache = True


@compiles(db_now_stable, "postgresql")
def _pg_now_stable(element: Any, compiler: Any, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)"


@compiles(db_now_stable, "sqlite")
def _sqlite_now_stable(element: Any, compiler: Any, **kw: Any) -> str:
    # SQLite evaluates 'now' once per statement already.
    return "((julianday('now') - 2440587.5) * 86400.0)"
