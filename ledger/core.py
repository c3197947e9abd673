"""The store's database core: one engine per process, transactions, the hot path's cursors, the
event writer, error translation.

Every query group (``hotpath``, ``sweeps``, ``operator``) is a mixin over this class and reaches
the database only through it:

- ``_txn()``: one transaction (``BEGIN IMMEDIATE`` on SQLite, READ COMMITTED on PostgreSQL);
- ``_one_statement()``: one atomic statement (autocommit on PostgreSQL: one round trip);
- ``_read()``: reads only (a deferred transaction on SQLite, which never blocks a writer under
  WAL; autocommit on PostgreSQL);
- ``fast``: the hot path's raw cursors (``fastpath``), and ``_fast_write`` to run an entries
  write with its audit event on one;
- ``_write_with_event`` / ``_append_events``: the one way an audit event is written.

Database errors become ``LedgerUnavailable`` in ``errors.as_unavailable`` only: every context
above, and the fast path, enters ``errors.translate_db_errors``. What differs between SQLite and
PostgreSQL is read from ``self.dialect`` (``dialect.Dialect``), here and in ``statements``,
never tested again in a query group.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy import Connection, Engine

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.budget import pool_options
from celery_ledger.ledger.dialect import dialect_for
from celery_ledger.ledger.engine import (
    READ_ONLY,
    driver_options,
    make_engine,
    normalize_url,
    parse_prepare_threshold,
    parse_url,
)
from celery_ledger.ledger.errors import SchemaError, translate_db_errors
from celery_ledger.ledger.fastpath import Compiled, FastPath, Pipelined
from celery_ledger.ledger.migrate import (
    current_revision,
    ensure_schema,
    head_revision,
    pending_revisions,
    schema_is_current,
)


@dataclass(frozen=True)
class Note:
    """What an audit event says about a transition: the event, who made it, why."""

    event: str
    actor: str | None
    detail: str | None = None

    def on(self, row: Sequence[Any]) -> dict[str, Any]:
        """The event row about ``row`` = (key, task_id, fence, status, ...): ``RETURNED``."""
        return {
            "key": row[0],
            "task_id": row[1],
            "fence": row[2],
            "event": self.event,
            "status": row[3],
            "actor": self.actor,
            "detail": self.detail,
        }


class _OnConnection:
    """Runs the event writer's statements on a SQLAlchemy connection (caller's transaction)."""

    __slots__ = ("conn",)

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def rows(self, stmt: Any, params: dict[str, Any]) -> Sequence[Any]:
        return self.conn.execute(stmt, params).all()

    def append_events(self, rows: list[dict[str, Any]]) -> None:
        self.conn.execute(sql.event_insert(), rows)


class _OnCursor:
    """Runs the event writer's statements on a hot-path cursor (its unit of work)."""

    __slots__ = ("cur", "hot")

    def __init__(self, hot: Callable[[Any], Compiled], cur: Any) -> None:
        self.hot = hot  # StoreCore._hot
        self.cur = cur

    def rows(self, stmt: Compiled, params: dict[str, Any]) -> Sequence[Any]:
        self.cur.execute(stmt.sql, stmt.params(params))
        return self.cur.fetchall()

    def append_events(self, rows: list[dict[str, Any]]) -> None:
        ev = self.hot("event")
        self.cur.executemany(ev.sql, [ev.params(r) for r in rows])


_Runner = _OnConnection | _OnCursor


#: ``ledger_durability`` values: ``effects`` (default) or ``every-write``.
DURABILITY = ("effects", "every-write")
DEFAULT_DURABILITY = "effects"


class StoreCore:
    """Engine handling, transactions, the hot path's cursors and the event writer."""

    def _lazy(self, guards_an_effect: bool) -> bool:
        """Whether a hot-path write may commit without waiting for the flush to disk: in
        ``effects`` mode, a write that lets no effect begin (docs/design.md, "Durability
        follows effects"). A server crash may lose it; recovery then sees the state before
        it, and every such state leads to a replay, a takeover or a block, never to a second
        run of an effect: the write that lets an effect begin waits, and its flush takes every
        earlier commit of the log with it."""
        return self._effects and not guards_an_effect

    def __init__(
        self,
        url: str,
        *,
        migrate: bool = True,
        engine_options: dict[str, Any] | None = None,
        durability: str = DEFAULT_DURABILITY,
        prepare_threshold: str | int | None = None,
        max_connections: int | None = None,
    ) -> None:
        if durability not in DURABILITY:
            raise ValueError(
                f"ledger durability {durability!r} is not one of: {', '.join(DURABILITY)}"
            )
        #: ``effects``: writes that guard no effect commit without waiting for the flush
        #: (``lazy``); ``every-write``: every commit waits (design.md § "Durability follows
        #: effects").
        self.durability = durability
        self._effects = durability == "effects"
        self.url = normalize_url(url)
        driver_options(parse_url(url))  # the URL's own parameters: refused now, not at first use
        self.dialect = dialect_for(url)
        self.is_sqlite = self.dialect.name == "sqlite"
        self._migrate = migrate
        # ``max_connections`` bounds this process's share (ledger/budget.py); options given
        # in ``engine_options`` win over it.
        bounded, self._fast_keep = pool_options(max_connections)
        self._engine_options = {**bounded, **(engine_options or {})}
        if prepare_threshold is not None:
            # psycopg's, on every connection of both engines; checked here, at construction
            # (``driver_options``: it wins over the URL's ``prepare_threshold=`` and ``pooler=``).
            parse_prepare_threshold(prepare_threshold)
            self._engine_options["prepare_threshold"] = prepare_threshold
        self._engine: Engine | None = None
        self._autocommit: Engine | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._schema_ready = False
        self._fast: FastPath | None = None
        #: Set by ``prepare_for_fork`` once both engines have connected (their dialects are
        #: initialized, so no first-connect lock can be held by a thread at a fork): only
        #: then does a forked child keep them.
        self._forkable = False

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"<{type(self).__name__} {url}>"

    # -- engine ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """This process's engine, built on first use and rebuilt after a fork."""
        if self._pid != os.getpid() or not self._schema_ready:
            with self._lock:
                if self._pid != os.getpid():
                    self._open_engine()
                if not self._schema_ready:
                    # Checked until it succeeds: a ledger that was down at the first call
                    # is checked (and migrated) at the first call that reaches it.
                    assert self._engine is not None
                    with translate_db_errors():
                        self._check_schema(self._engine)
                    self._schema_ready = True
        assert self._engine is not None
        return self._engine

    def _open_engine(self) -> None:
        if self._engine is not None and self._fast is not None and self._forkable:
            # Inherited through fork(): SQLAlchemy's pattern for a child process. Each engine
            # forgets the parent's pooled connections without closing them (closing would
            # end the parent's sessions on its sockets) and keeps the rest, its dialect
            # initialized and the hot path's compiled statements included, shared
            # copy-on-write with the parent: building them again cost each pool process
            # about 5 MiB of private memory.
            self._engine.dispose(close=False)
            if self._fast.engine is not self._engine:
                self._fast.engine.dispose(close=False)
            self._fast = self._fast.forked()
            self._pid = os.getpid()
            return
        self._fast = None
        engine = make_engine(self.url, **self._engine_options)
        self._engine = engine
        if self.dialect.autocommit:
            self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
            # The hot path's raw connections come from an engine of their own, always in
            # autocommit, so they can never leak autocommit into a pooled connection that a
            # SQLAlchemy transaction later checks out.
            fast_engine = make_engine(
                self.url, **{**self._engine_options, "isolation_level": "AUTOCOMMIT"}
            )
        else:
            self._autocommit = fast_engine = engine
        keep = {} if self._fast_keep is None else {"keep": self._fast_keep}
        self._fast = FastPath(fast_engine, self.dialect, **keep)
        self._pid = os.getpid()

    def _check_schema(self, engine: Engine) -> None:
        if schema_is_current(engine):
            return
        if self._migrate:
            ensure_schema(engine)
            return
        with engine.connect() as conn:
            current = current_revision(conn)
            # Raises SchemaTooNew for a newer database: `migrate` would be the wrong advice.
            pending = pending_revisions(conn)
        if pending and current is None:
            raise SchemaError(
                "no ledger schema in this database yet: run `celery-ledger migrate` to create it"
            )
        if pending:
            raise SchemaError(
                f"ledger schema is at {current!r}, this code needs {head_revision()!r}: "
                "run `celery-ledger migrate`"
            )

    def ensure_ready(self) -> None:
        """Connect and check (or migrate) the schema now instead of at first use.

        Raises:
            LedgerUnavailable: the database cannot be reached.
            SchemaError: the schema cannot be used by this code.
        """
        self.engine  # noqa: B018 - the property connects and checks

    def dispose(self) -> None:
        """Close this process's connections (the store reopens on next use)."""
        if self._engine is not None and self._pid == os.getpid():
            if self._fast is not None:
                self._fast.close()
                if self._fast.engine is not self._engine:
                    self._fast.engine.dispose()
            self._engine.dispose()
        self._fast = None
        self._engine = None
        self._forkable = False
        self._pid = -1

    # -- transactions ---------------------------------------------------------------------

    @contextmanager
    def _txn(self) -> Iterator[Connection]:
        """One transaction (BEGIN IMMEDIATE on SQLite, READ COMMITTED on PostgreSQL)."""
        with translate_db_errors(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _one_statement(self) -> Iterator[Connection]:
        """A connection for a single atomic statement: autocommit on PostgreSQL."""
        self.engine  # noqa: B018 - builds the engine (and _autocommit) for this process
        assert self._autocommit is not None
        with translate_db_errors(), self._autocommit.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        """A connection for reads only: a deferred transaction on SQLite (never blocks
        writers under WAL), autocommit on PostgreSQL."""
        self.engine  # noqa: B018 - builds the engine (and _autocommit) for this process
        assert self._autocommit is not None
        with translate_db_errors(), self._autocommit.connect() as conn:
            conn = conn.execution_options(**{READ_ONLY: True})
            with conn.begin():
                yield conn

    @property
    def fast(self) -> FastPath:
        """This process's hot-path connections (see ``celery_ledger.ledger.fastpath``)."""
        self.engine  # noqa: B018 - builds the engine (and the fast path) for this process
        assert self._fast is not None
        return self._fast

    # -- the event writer -----------------------------------------------------------------

    def _write_with_event(
        self,
        on: Connection | _Runner,
        stmt: Any,
        params: dict[str, Any],
        note: Note,
    ) -> list[Any]:
        """Run an entries write built by ``sql.with_event`` and append ``note`` for each row.

        The write returns ``RETURNED`` (key, task_id, fence, status; more columns may follow).
        PostgreSQL: one statement (a data-modifying CTE), so one round trip and atomic even in
        autocommit. SQLite: the events follow in the caller's transaction (``_append_events``).
        Returns the rows the write returned.
        """
        run = _OnConnection(on) if isinstance(on, Connection) else on
        if self.dialect.event_in_statement:
            binds = {"ev_event": note.event, "ev_actor": note.actor, "ev_detail": note.detail}
            return list(run.rows(stmt, {**params, **binds}))
        rows = list(run.rows(stmt, params))
        self._append_events(run, note, rows)
        return rows

    def _send_with_event(
        self, unit: Pipelined, stmt: Compiled, params: dict[str, Any], note: Note
    ) -> Callable[[], list[Any]]:
        """``_write_with_event`` in a pipelined unit (``FastPath.pipelined``): the write is
        sent, and its rows read when the returned function is called. PostgreSQL: one
        statement, nothing waits for it until then. SQLite: it runs now, its events with it."""
        if self.dialect.event_in_statement:
            binds = {"ev_event": note.event, "ev_actor": note.actor, "ev_detail": note.detail}
            sent = unit.send(stmt, {**params, **binds})
            return lambda: list(sent.fetchall())
        rows = self._write_with_event(_OnCursor(self._hot, unit.cur), stmt, params, note)
        return lambda: rows

    def _append_events(
        self, on: Connection | _Runner, note: Note, rows: Sequence[Sequence[Any]]
    ) -> None:
        """Append ``note`` about each of ``rows`` (key, task_id, fence, status) in the caller's
        transaction: the second half of ``_write_with_event`` on SQLite, and the whole of a
        gate that decides without writing the entry (WAIT, RETURN, CONFLICT, BLOCK)."""
        if rows:
            run = _OnConnection(on) if isinstance(on, Connection) else on
            run.append_events([note.on(r) for r in rows])

    def _hot(self, key: Any) -> Compiled:
        """The hot-path statement ``sql.HOT[key]``, compiled once for this store's dialect."""
        return self.fast.compiled(key, partial(sql.HOT[key], self.dialect))

    def _fast_write(
        self, key: Any, params: dict[str, Any], note: Note, *, lazy: bool = False
    ) -> list[Any]:
        """``_write_with_event`` on the hot path: the statement ``sql.HOT[key]`` run in one unit
        of work on a raw cursor (``lazy``: see ``_lazy``)."""
        fast = self.fast
        stmt = self._hot(key)
        with fast.cursor(lazy=lazy) as cur:
            return self._write_with_event(_OnCursor(self._hot, cur), stmt, params, note)
