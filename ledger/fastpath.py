"""The hot path on a raw DBAPI cursor: statements compiled once, executed without SQLAlchemy's
execution layer.

Measured on this machine: claim + settle through ``Connection.execute`` cost 0.74 ms of client
CPU per task, through a bare psycopg cursor 0.19 ms. A Celery worker keeps its cores busy with
its own work, so every CPU millisecond the ledger spends per task is throughput lost. Claim,
settle, step writes and lease renewal (once or more per task) therefore run here; everything
else (the claim's slow path, sweeps, operators) keeps SQLAlchemy, whose statements these are:
they are built with SQLAlchemy Core in ``ledger.statements`` and compiled for the dialect once.

Each unit of work checks a raw connection out of the store's pool and returns it (a thread
pool of any size shares the pool; nothing is pinned to a thread). On PostgreSQL those
connections are in autocommit, so a one-statement write is one round trip; on SQLite each unit
is an explicit ``BEGIN IMMEDIATE`` ... ``COMMIT``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine

from ledger.errors import LedgerUnavailable


class Compiled:
    """One statement compiled for one dialect, with its parameter layout."""

    def __init__(self, stmt: Any, engine: Engine) -> None:
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

    def __init__(self, engine: Engine, *, sqlite: bool) -> None:
        self.engine = engine
        self._sqlite = sqlite
        self._compiled: dict[Any, Compiled] = {}
        #: Called with each SQL string sent (benchmarks count round trips with it); empty in
        #: production, where the cursor is handed out as it is.
        self.listeners: list[Callable[[str], None]] = []
        dbapi = engine.dialect.dbapi
        assert dbapi is not None
        #: DBAPI errors that mean "the database is not reachable (or not now)".
        self._unavailable: tuple[type[BaseException], ...] = (
            dbapi.OperationalError,
            dbapi.InterfaceError,
        )

    def compiled(self, key: Any, build: Callable[[], Any]) -> Compiled:
        found = self._compiled.get(key)
        if found is None:
            found = self._compiled[key] = Compiled(build(), self.engine)
        return found

    @contextmanager
    def cursor(self) -> Iterator[Any]:
        """A cursor for one atomic unit of work (one statement on PostgreSQL).

        Raises:
            LedgerUnavailable: the database cannot be reached; the connection is dropped and
                the next call connects again.
        """
        try:
            conn = self.engine.raw_connection()
        except Exception as exc:  # SQLAlchemy wraps the driver's connect errors
            raise LedgerUnavailable(f"ledger database unavailable: {exc}") from exc
        cur = conn.cursor() if not self.listeners else _Observed(conn.cursor(), self.listeners)
        try:
            if self._sqlite:
                cur.execute("BEGIN IMMEDIATE")
            yield cur
            if self._sqlite:
                cur.execute("COMMIT")
        except self._unavailable as exc:
            with contextlib.suppress(Exception):  # it is broken already; drop it
                conn.invalidate()
            raise LedgerUnavailable(f"ledger database unavailable: {exc}") from exc
        except BaseException:
            if self._sqlite:  # on PostgreSQL (autocommit) there is nothing to roll back
                with contextlib.suppress(Exception):
                    cur.execute("ROLLBACK")
            raise
        finally:
            cur.close()
            conn.close()  # back to the pool (an invalidated one is discarded)


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
