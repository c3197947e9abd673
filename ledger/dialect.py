"""What the store does differently on SQLite and on PostgreSQL, named, in one place.

The store's query groups never ask "is this SQLite?": the core (``celery_ledger.ledger.core``),
the hot path's cursors (``fastpath``) and the statement builders (``statements``) read the
capability they need from a ``Dialect``, and the reason for each difference is written once,
here. What needs no entry: ``FOR UPDATE`` / ``FOR SHARE`` / ``SKIP LOCKED``, which SQLAlchemy
renders as nothing on SQLite, where every write transaction is ``BEGIN IMMEDIATE`` and so
excludes every other writer already; the database clock (``dbclock``), which compiles per
dialect; and the partial indexes, which the schema declares for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from celery_ledger.ledger.engine import is_sqlite


@dataclass(frozen=True)
class Dialect:
    """The differences between the ledger's two databases that the store relies on."""

    #: SQLAlchemy's name for the dialect.
    name: str
    #: Whether a one-statement method runs in autocommit. PostgreSQL: yes, which saves the
    #: BEGIN and COMMIT round trips (and the hot path's connections are always in autocommit).
    #: SQLite: every method is a ``BEGIN IMMEDIATE`` transaction anyway, since the file lock is
    #: the serialization point, and there is no round trip to save in-process.
    autocommit: bool
    #: Whether an entries write and its audit event are one statement (a data-modifying CTE,
    #: atomic even in autocommit). SQLite has no data-modifying CTE: the event rows follow in
    #: the same transaction, as a second statement.
    event_in_statement: bool
    #: SQLAlchemy's INSERT for this dialect: ``ON CONFLICT`` exists only per dialect.
    insert: Callable[..., Any]
    #: What makes a connection's commits stop waiting for the flush to disk (``effects``
    #: durability, design.md § "Durability follows effects"). PostgreSQL: the commit returns before
    #: its WAL is flushed, and a
    #: server crash may lose it; a later synchronous commit of any session flushes it (one
    #: sequential WAL). SQLite (WAL mode): the WAL is not fsynced at commit, so a power loss
    #: (not a process crash) may lose it; a later FULL commit fsyncs the WAL file, it too.
    lazy_commit: str = ""

    @property
    def begin_unit(self) -> str | None:
        """The statement that opens a unit of work on a raw hot-path connection, or None.

        SQLite: the engine takes transaction control away from the sqlite3 module
        (``engine.py``), so a unit says ``BEGIN IMMEDIATE`` itself, taking the write lock up
        front. PostgreSQL: the connection is in autocommit and a unit is one statement.
        """
        return None if self.autocommit else "BEGIN IMMEDIATE"


SQLITE = Dialect(
    "sqlite",
    autocommit=False,
    event_in_statement=False,
    insert=sqlite_dialect.insert,
    lazy_commit="PRAGMA synchronous=NORMAL",
)
POSTGRESQL = Dialect(
    "postgresql",
    autocommit=True,
    event_in_statement=True,
    insert=pg_dialect.insert,
    lazy_commit="SET synchronous_commit = off",
)


def dialect_for(url: str) -> Dialect:
    """The ``Dialect`` of a ledger URL (``make_engine`` refuses any other backend)."""
    return SQLITE if is_sqlite(url) else POSTGRESQL
