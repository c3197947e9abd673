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

from sqlalchemy import Select, func, literal_column, true
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
    #: How a hot-path write asks that its commit not wait for the flush to disk (``effects``
    #: durability, design.md § "Durability follows effects"). Exactly one of the two is set.
    #:
    #: ``lazy_session``, SQLite (WAL mode): a setting of the connection, run once when a lazy
    #: connection is opened (the fast path keeps those on a free list of their own). The WAL is
    #: not fsynced at commit, so a power loss (not a process crash) may lose the commit; a later
    #: FULL commit fsyncs the WAL file, it too. A SQLite connection is the process's own, so
    #: the setting reaches nobody else.
    lazy_session: str = ""
    #: ``lazy_statement``, PostgreSQL: the statement rewritten to ask for it itself
    #: (``commit_lazily``), for its own transaction only. The commit returns before its WAL is
    #: flushed, and a server crash may lose it; a later synchronous commit of any session
    #: flushes it (one sequential WAL). Never a session setting: behind a transaction pooler
    #: (PgBouncer) a server session serves other clients next, and a ``SET synchronous_commit
    #: = off`` would change their durability (docs/operations.md § "Deploying").
    lazy_statement: Callable[[Any], Any] | None = None
    #: Whether a fork waits for this process's uses of a connection (``forkgate``): SQLite
    #: keeps its file locks in the process's memory, which a fork copies.
    gates_forks: bool = False

    @property
    def begin_unit(self) -> str | None:
        """The statement that opens a unit of work on a raw hot-path connection, or None.

        SQLite: the engine takes transaction control away from the sqlite3 module
        (``engine.py``), so a unit says ``BEGIN IMMEDIATE`` itself, taking the write lock up
        front. PostgreSQL: the connection is in autocommit and a unit is one statement.
        """
        return None if self.autocommit else "BEGIN IMMEDIATE"


#: ``set_config(..., true)`` is ``SET LOCAL``: the setting ends with the transaction, and
#: PostgreSQL reads ``synchronous_commit`` when the transaction commits, so a statement that
#: sets it while it runs decides how its own (autocommit) transaction commits, at no extra
#: round trip. Rendered inline: the statement keeps its bind parameters.
_NO_FLUSH_WAIT = func.set_config(
    literal_column("'synchronous_commit'"), literal_column("'off'"), true()
).label("commit_lazily")


def commit_lazily(stmt: Any) -> Any:
    """``stmt`` (a SELECT, or a DML statement) asking its own transaction to commit without
    waiting for the WAL flush: ``set_config`` in its select list or its ``RETURNING``.

    Evaluated for each row the statement returns, that is, for each row a hot-path write
    writes (each returns or counts the rows it wrote). A statement that writes no row commits
    nothing that a flush would wait for.
    """
    if isinstance(stmt, Select):
        return stmt.add_columns(_NO_FLUSH_WAIT)
    return stmt.returning(_NO_FLUSH_WAIT)


SQLITE = Dialect(
    "sqlite",
    autocommit=False,
    event_in_statement=False,
    insert=sqlite_dialect.insert,
    lazy_session="PRAGMA synchronous=NORMAL",
    gates_forks=True,
)
POSTGRESQL = Dialect(
    "postgresql",
    autocommit=True,
    event_in_statement=True,
    insert=pg_dialect.insert,
    lazy_statement=commit_lazily,
)


def dialect_for(url: str) -> Dialect:
    """The ``Dialect`` of a ledger URL (``make_engine`` refuses any other backend)."""
    return SQLITE if is_sqlite(url) else POSTGRESQL
