"""The hot path on a raw DBAPI cursor: statements compiled once, executed without SQLAlchemy's
execution layer.

Measured on this machine: claim + settle through ``Connection.execute`` cost 0.74 ms of client
CPU per task, through a bare psycopg cursor 0.19 ms. A Celery worker keeps its cores busy with
its own work, so every CPU millisecond the ledger spends per task is throughput lost. Claim,
settle, step writes and lease renewal (once or more per task) therefore run here; everything
else (the claim's slow path, sweeps, operators) keeps SQLAlchemy, whose statements these are:
they are built with SQLAlchemy Core in ``celery_ledger.ledger.statements`` and compiled for the
dialect once.

The fast path owns its connections: it takes each one from the engine once (so it is set up
like any other: connect arguments, SQLite pragmas), detaches it from the pool and keeps it on a
free list between units of work. A unit of work pops a connection and pushes it back, with no
pool checkout, reset-on-return or event dispatch per statement (measured: 0.06 ms of client CPU
per statement on this machine, a tenth of the claim's). Nothing is pinned to a thread, so a
thread pool of any size shares the list; at most ``keep`` connections wait on it, any beyond
are closed when returned. A connection that failed, or whose unit raised, is closed, not kept.
On PostgreSQL the connections are in autocommit, so a one-statement write is one round trip; on
SQLite each unit is an explicit ``BEGIN IMMEDIATE`` ... ``COMMIT``. A driver error, at connect or
at execute, is classified by ``errors.as_unavailable``, as on every other path.

Durability (design.md § "Durability follows effects"): a unit of work is ``lazy`` when its
commit need not wait for the flush to disk; a write that guards no effect is one in ``effects``
mode. How it asks is the dialect's (``Dialect.lazy_statement``, ``Dialect.lazy_session``). On
PostgreSQL each hot statement has a lazy twin, compiled with it, that asks within its own
transaction (``set_config('synchronous_commit', 'off', true)`` in its select list or
``RETURNING``): a lazy unit's cursor sends the twin, on any connection, at no extra round trip,
and nothing outlives the transaction, so a transaction pooler that hands the server session to
another client hands it over unchanged (docs/operations.md § "Deploying"). A ``SET LOCAL``
would need a transaction block (two more round trips in autocommit). On SQLite a second free
list holds connections set up lazily once, when opened (``PRAGMA synchronous=NORMAL``).

After ``fork()`` the store keeps the fast path's engine and compiled statements (``forked``)
and forgets its connections without closing them (they are the parent's sessions; psycopg does
not end a session from a process that did not open it).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine

from celery_ledger.ledger.dialect import Dialect
from celery_ledger.ledger.errors import translate_db_errors
from celery_ledger.ledger.forkgate import GATE


class Compiled:
    """One statement compiled for one dialect, with its parameter layout."""

    def __init__(self, stmt: Any, engine: Engine) -> None:
        self.statement = stmt
        compiled = stmt.compile(dialect=engine.dialect)
        self.sql: str = compiled.string
        self._compiled = compiled
        self._order: tuple[str, ...] | None = (
            tuple(compiled.positiontup or ()) if compiled.positional else None
        )

    def params(self, values: dict[str, Any]) -> Any:
        """The DBAPI parameters for ``values`` (constants baked into the statement included)."""
        bound = self._compiled.construct_params(values, _check=False)
        if self._order is None:
            return bound
        return tuple(bound[name] for name in self._order)


class FastPath:
    """A process's hot-path statements, compiled once, and raw cursors to run them on."""

    def __init__(self, engine: Engine, dialect: Dialect, *, keep: int = 2) -> None:
        self.engine = engine
        self._begin = dialect.begin_unit
        self._lazy_session = dialect.lazy_session
        self._lazy_statement = dialect.lazy_statement
        #: Held for each unit of work where a fork must wait for it (SQLite, ``forkgate``).
        self._gate: Callable[[], contextlib.AbstractContextManager[Any]] = (
            GATE.held if dialect.gates_forks else contextlib.nullcontext
        )
        #: Each compiled statement's lazy twin, by SQL (``Dialect.lazy_statement``).
        self._lazy_sql: dict[str, str] = {}
        #: Idle DBAPI connections, last in first out (list.pop/append are atomic); on SQLite,
        #: those whose commits do not wait for the flush (``lazy``) are kept apart.
        self._idle: list[Any] = []
        self._idle_lazy: list[Any] = []
        self._keep = keep
        self._pid = os.getpid()
        self._compiled: dict[Any, Compiled] = {}
        #: Called with each SQL string sent (benchmarks count round trips with it); empty in
        #: production, where the cursor is handed out as it is.
        self.listeners: list[Callable[[str], None]] = []
        #: The driver module, whose raw errors ``translate_db_errors`` classifies.
        self.dbapi: Any = engine.dialect.dbapi

    def forked(self) -> FastPath:
        """This fast path in a child process: the same engine and compiled statements, none
        of the parent's connections (forgotten, not closed: they are the parent's sessions)."""
        child = copy.copy(self)  # the compiled statements: the same objects, shared
        child._idle, child._idle_lazy = [], []
        child._pid = os.getpid()
        child.listeners = list(self.listeners)
        return child

    def compiled(self, key: Any, build: Callable[[], Any]) -> Compiled:
        found = self._compiled.get(key)
        if found is None:
            found = Compiled(build(), self.engine)
            if self._lazy_statement is not None:
                twin = Compiled(self._lazy_statement(found.statement), self.engine)
                # The twin runs with the statement's own parameters (``Compiled.params``).
                if twin.params({}) != found.params({}):
                    raise RuntimeError(f"the lazy twin of {key!r} changed its parameters")
                self._lazy_sql[found.sql] = twin.sql
            self._compiled[key] = found
        return found

    def _connect(self, idle: list[Any], lazy: bool) -> Any:
        try:
            return idle.pop()
        except IndexError:
            pass
        fairy = self.engine.raw_connection()  # a failure is the driver's own error
        fairy.detach()  # ours from now on: closed by this class, never returned to the pool
        conn: Any = fairy.dbapi_connection
        if lazy:
            try:
                cur = conn.cursor()
                cur.execute(self._lazy_session)
                cur.close()
            except BaseException:
                with contextlib.suppress(Exception):
                    conn.close()
                raise
        return conn

    @contextmanager
    def cursor(self, *, lazy: bool = False) -> Iterator[Any]:
        """A cursor for one atomic unit of work (one statement on PostgreSQL).

        ``lazy``: on a connection whose commit does not wait for the flush to disk (a server
        crash may lose it; a later durable commit flushes it too).

        Raises:
            LedgerUnavailable: the database cannot be reached (connect or execute); the
                connection is closed and the next call connects again.
        """
        session = lazy and bool(self._lazy_session)
        idle = self._idle_lazy if session else self._idle
        with self._gate(), translate_db_errors(self.dbapi):
            conn = self._connect(idle, session)
            cur = self._wrap(conn.cursor(), lazy)
            reuse = False
            try:
                if self._begin:
                    cur.execute(self._begin)
                yield cur
                if self._begin:
                    cur.execute("COMMIT")
                reuse = True
            except BaseException:
                if self._begin:  # in autocommit (PostgreSQL) there is nothing to roll back
                    with contextlib.suppress(Exception):
                        cur.execute("ROLLBACK")
                raise
            finally:
                with contextlib.suppress(Exception):  # a broken one is closed below anyway
                    cur.close()
                if reuse and len(idle) < self._keep:
                    idle.append(conn)
                else:
                    with contextlib.suppress(Exception):  # it may be broken already
                        conn.close()

    def _wrap(self, cur: Any, lazy: bool) -> Any:
        """A raw cursor as ``cursor`` hands it out: observed, and sending lazy twins."""
        if self.listeners:
            cur = _Observed(cur, self.listeners)
        if lazy and self._lazy_statement is not None:
            cur = _Lazy(cur, self._lazy_sql)
        return cur

    @contextmanager
    def pipelined(self, *, lazy: bool = False) -> Iterator[Pipelined]:
        """``cursor`` for a unit of several statements whose results are read only when the
        unit needs them: each is sent on a cursor of its own (``Pipelined.send``). With
        psycopg (PostgreSQL) the unit runs in the driver's pipeline mode, so the statements
        sent before a read go out together and cost one round trip; the server still runs
        them one after the other, in order, each under READ COMMITTED with a snapshot of its
        own. Elsewhere each statement runs when it is sent, as on ``cursor``. A transaction
        block is the caller's, as on ``cursor`` (PostgreSQL's connections are in
        autocommit).
        """
        with self.cursor(lazy=lazy) as cur:
            conn = cur.connection
            pipeline = getattr(conn, "pipeline", None)
            with pipeline() if pipeline is not None else contextlib.nullcontext():
                yield Pipelined(cur, lambda: self._wrap(conn.cursor(), lazy))

    def close(self) -> None:
        """Close the idle connections (in the process that opened them only)."""
        if self._pid != os.getpid():
            self._idle = []
            self._idle_lazy = []
            return
        for idle in (self._idle, self._idle_lazy):
            while idle:
                with contextlib.suppress(Exception):
                    idle.pop().close()


class Pipelined:
    """The statements of one unit of work (``FastPath.pipelined``), each sent on a cursor of
    its own so that its result can be read after later ones were sent."""

    __slots__ = ("cur", "_new")

    def __init__(self, cur: Any, new: Callable[[], Any]) -> None:
        #: The unit's first cursor (``BEGIN``, ``COMMIT``, and statements read at once).
        self.cur = cur
        self._new = new

    def send(self, stmt: Compiled, params: dict[str, Any]) -> Any:
        """Send ``stmt``; returns its cursor, to fetch from when the result is needed."""
        cur = self._new()
        cur.execute(stmt.sql, stmt.params(params))
        return cur


class _Lazy:
    """A cursor that sends each compiled statement's lazy twin in its place (any other SQL
    as it is: its commit waits, the safe side)."""

    __slots__ = ("_cur", "_twins")

    def __init__(self, cur: Any, twins: dict[str, str]) -> None:
        self._cur = cur
        self._twins = twins

    def execute(self, sql: str, params: Any = None) -> Any:
        sql = self._twins.get(sql, sql)
        return self._cur.execute(sql) if params is None else self._cur.execute(sql, params)

    def executemany(self, sql: str, seq: Any) -> Any:
        return self._cur.executemany(self._twins.get(sql, sql), seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _Observed:
    """A cursor that tells ``listeners`` about every statement it sends."""

    def __init__(self, cur: Any, listeners: list[Callable[[str], None]]) -> None:
        self._cur = cur
        self._listeners = listeners

    def execute(self, sql: str, params: Any = None) -> Any:
        for listener in self._listeners:
            listener(sql)
        return self._cur.execute(sql) if params is None else self._cur.execute(sql, params)

    def executemany(self, sql: str, seq: Any) -> Any:
        for listener in self._listeners:
            listener(sql)
        return self._cur.executemany(sql, seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)
