"""The ledger store: claim, heartbeat, replay rows and settle.

Contract of every public method:
- it is one transaction (on PostgreSQL a single-statement method runs in autocommit, which is
  one round trip; the audit event rides in the same statement as a data-modifying CTE);
- every write after the claim is fenced: ``WHERE key = :k AND fence = :f`` checked by the
  rowcount. A lost race (another attempt took over) returns ``False``/a gate; it never raises;
- ``LedgerUnavailable`` is raised when the database cannot be reached.

Sweep queries and operator queries live in ``celery_ledger.ledger.sweeps`` and
``celery_ledger.ledger.operator`` as mixins of the same class, so that each module stays one idea.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, insert, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.sql.dml import ReturningInsert, ReturningUpdate

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.dbclock import db_now
from celery_ledger.ledger.engine import READ_ONLY, is_sqlite, make_engine, normalize_url
from celery_ledger.ledger.errors import LedgerUnavailable, SchemaError
from celery_ledger.ledger.fastpath import FastPath
from celery_ledger.ledger.migrate import (
    current_revision,
    ensure_schema,
    head_revision,
    pending_revisions,
    schema_is_current,
)
from celery_ledger.ledger.schema import entries, events, steps
from celery_ledger.ledger.states import EntryStatus, Gate, StepStatus
from celery_ledger.ledger.values import RESUME_OWNER, Claim, ClaimRequest, StepRecord

log = logging.getLogger(__name__)

_RETURNED = sql.RETURNED


class StoreCore:
    """Engine handling, transactions and the shared write helpers."""

    def __init__(
        self, url: str, *, migrate: bool = True, engine_options: dict[str, Any] | None = None
    ) -> None:
        self.url = normalize_url(url)
        self.is_sqlite = is_sqlite(url)
        self.dialect = "sqlite" if self.is_sqlite else "postgresql"
        self._migrate = migrate
        self._engine_options = dict(engine_options or {})
        self._engine: Engine | None = None
        self._autocommit: Engine | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._schema_ready = False
        self._fast: FastPath | None = None

    def __repr__(self) -> str:
        return f"<LedgerStore {self.engine.url.render_as_string(hide_password=True)}>"

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
                    with self._translate():
                        self._check_schema(self._engine)
                    self._schema_ready = True
        assert self._engine is not None
        return self._engine

    def _open_engine(self) -> None:
        if self._engine is not None:
            # Inherited through fork(): forget the parent's connections without closing
            # them, since closing would end the parent's sessions on its sockets.
            self._engine.dispose(close=False)
        self._fast = None  # its connections belonged to the parent, like the engine's
        engine = make_engine(self.url, **self._engine_options)
        self._engine = engine
        # On SQLite every method is a BEGIN IMMEDIATE transaction anyway (the file lock is
        # the serialization point); on PostgreSQL a one-statement method needs no BEGIN.
        self._autocommit = (
            engine if self.is_sqlite else engine.execution_options(isolation_level="AUTOCOMMIT")
        )
        # The hot path's raw connections come from an engine of their own on PostgreSQL,
        # always in autocommit, so they can never leak autocommit into a pooled connection
        # that a SQLAlchemy transaction later checks out.
        fast_engine = (
            engine
            if self.is_sqlite
            else make_engine(self.url, **{**self._engine_options, "isolation_level": "AUTOCOMMIT"})
        )
        self._fast = FastPath(fast_engine, sqlite=self.is_sqlite)
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
        self._pid = -1

    # -- transactions ---------------------------------------------------------------------

    @contextmanager
    def _translate(self) -> Iterator[None]:
        try:
            yield
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            raise LedgerUnavailable(f"ledger database unavailable: {exc.orig or exc}") from exc

    @contextmanager
    def _txn(self) -> Iterator[Connection]:
        """One transaction (BEGIN IMMEDIATE on SQLite, READ COMMITTED on PostgreSQL)."""
        with self._translate(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _one_statement(self) -> Iterator[Connection]:
        """A connection for a single atomic statement: autocommit on PostgreSQL."""
        self.engine  # noqa: B018 - builds the engine (and _autocommit) for this process
        assert self._autocommit is not None
        with self._translate(), self._autocommit.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        """A connection for reads only: a deferred transaction on SQLite (never blocks
        writers under WAL), autocommit on PostgreSQL."""
        self.engine  # noqa: B018 - builds the engine (and _autocommit) for this process
        assert self._autocommit is not None
        with self._translate(), self._autocommit.connect() as conn:
            conn = conn.execution_options(**{READ_ONLY: True})
            with conn.begin():
                yield conn

    @property
    def fast(self) -> FastPath:
        """This process's hot-path connections (see ``celery_ledger.ledger.fastpath``)."""
        self.engine  # noqa: B018 - builds the engine (and the fast path) for this process
        assert self._fast is not None
        return self._fast

    def _fast_with_event(
        self,
        key: Any,
        build: Any,
        params: dict[str, Any],
        event: str,
        actor: str | None,
        detail: str | None = None,
    ) -> list[Any]:
        """Run a ``sql.with_event`` statement on the hot path; return its (key, task_id,
        fence, status, ...) rows as tuples. One statement on PostgreSQL; on SQLite the event
        rows follow in the same transaction."""
        fast = self.fast
        stmt = fast.compiled(key, build)
        with fast.cursor() as cur:
            if self.is_sqlite:
                cur.execute(stmt.sql, stmt.params(params))
                rows = cur.fetchall()
                if rows:
                    ev = fast.compiled("event", sql.event_insert)
                    cur.executemany(
                        ev.sql,
                        [
                            ev.params(
                                {
                                    "key": r[0],
                                    "task_id": r[1],
                                    "fence": r[2],
                                    "event": event,
                                    "status": r[3],
                                    "actor": actor,
                                    "detail": detail,
                                }
                            )
                            for r in rows
                        ],
                    )
                return list(rows)
            cur.execute(
                stmt.sql,
                stmt.params({**params, "ev_event": event, "ev_actor": actor, "ev_detail": detail}),
            )
            return list(cur.fetchall())

    # -- shared write helpers -------------------------------------------------------------

    def _insert_dialect(self) -> Any:
        return sqlite_dialect.insert if self.is_sqlite else pg_dialect.insert

    def _write_with_event(
        self,
        conn: Connection,
        dml: ReturningInsert[Any] | ReturningUpdate[Any],
        event: str,
        actor: str | None,
        detail: str | None = None,
    ) -> list[Any]:
        """Run an entries INSERT/UPDATE that returns ``RETURNED`` and append one event per row.

        PostgreSQL: one statement (a data-modifying CTE), so one round trip and atomic even
        in autocommit. SQLite: two statements inside the caller's transaction.
        Returns the rows the DML returned (at least key, task_id, fence, status).
        """
        return self._run_with_event(
            conn, sql.with_event(self.dialect, dml), {}, event, actor, detail
        )

    def _run_with_event(
        self,
        conn: Connection,
        stmt: Any,
        params: dict[str, Any],
        event: str,
        actor: str | None,
        detail: str | None = None,
    ) -> list[Any]:
        """Execute a statement built by ``sql.with_event`` with ``params``."""
        if self.is_sqlite:
            rows = list(conn.execute(stmt, params).all())
            if rows:
                conn.execute(
                    sql.event_insert(),
                    [
                        {
                            "key": r.key,
                            "task_id": r.task_id,
                            "fence": r.fence,
                            "event": event,
                            "status": r.status,
                            "actor": actor,
                            "detail": detail,
                        }
                        for r in rows
                    ],
                )
            return rows
        return list(
            conn.execute(
                stmt, {**params, "ev_event": event, "ev_actor": actor, "ev_detail": detail}
            ).all()
        )

    def _append_event(
        self,
        conn: Connection,
        key: str,
        event: str,
        *,
        task_id: str | None,
        fence: int | None,
        status: str | None,
        actor: str | None,
        detail: str | None = None,
    ) -> None:
        conn.execute(
            insert(events).values(
                key=key,
                task_id=task_id,
                fence=fence,
                event=event,
                status=status,
                actor=actor,
                detail=detail,
                at=db_now(),
            )
        )

    def _load_steps(self, conn: Connection, key: str) -> tuple[StepRecord, ...]:
        rows = conn.execute(
            select(steps).where(steps.c.key == key).order_by(steps.c.seq, steps.c.occurrence)
        ).all()
        return tuple(
            StepRecord(
                name=r.name,
                input_hash=r.input_hash,
                occurrence=r.occurrence,
                seq=r.seq,
                status=StepStatus(r.status),
                fence=r.fence,
                output=r.output,
                external_ref=r.external_ref,
                error=r.error,
                attempts=r.attempts,
                authorized=r.authorized,
                started_at=r.started_at,
                completed_at=r.completed_at,
            )
            for r in rows
        )


class HotPath(StoreCore):
    """What every ledgered task does: claim, renew, write steps, settle."""

    # -- claim ----------------------------------------------------------------------------

    def claim(self, req: ClaimRequest) -> Claim:
        """Atomically create the entry, or decide what the existing entry means for this delivery.

        Any number of concurrent claims of a new key yield exactly one RUN (the primary key
        decides); the rest see the winner's row and get WAIT. Every gate is appended to the
        events. Returns the ``Claim``; never raises for a lost race.
        """
        for _ in range(3):
            fence = self._insert_new(req)
            if fence is not None:
                return Claim(Gate.RUN, req.key, fence)
            with self._txn() as conn:
                claim = self._claim_existing_txn(conn, req)
            if claim is not None:
                return claim
            # The row vanished between our insert and our read (pruned): insert again.
        raise RuntimeError(f"claim of {req.key} did not converge")  # pragma: no cover

    def _insert_new(self, req: ClaimRequest) -> int | None:
        rows = self._insert_entry(
            req, req.owner.node, req.owner.boot, req.owner.pid, executions=1, event="claimed"
        )
        return int(rows[0][2]) if rows else None

    def record_intent(self, req: ClaimRequest) -> bool:
        """Record a task at publish time, before any worker has it (one statement).

        The entry is ``running`` under the resume marker with a lease of
        ``req.lease_seconds`` and no execution: the first claim runs it (RUN, not TAKEOVER);
        if the message is lost before any claim (``filesystem://`` forgets what a killed
        worker had fetched), the lease expires and the sweep re-enqueues it like any
        interrupted entry. Returns False if the key already has an entry (nothing written).
        """
        return bool(self._insert_entry(req, RESUME_OWNER, None, None, executions=0, event="queued"))

    def _insert_entry(
        self,
        req: ClaimRequest,
        owner: str,
        boot: str | None,
        pid: int | None,
        *,
        executions: int,
        event: str,
    ) -> list[Any]:
        """The claim's insert (``sql.claim_insert``): a new running entry, or no row if the
        key exists. A claim owns it with one execution; a publish intent with none."""
        return self._fast_with_event(
            "claim",
            lambda: sql.claim_insert(self.dialect),
            {
                "key": req.key,
                "task_name": req.task_name,
                "task_id": req.task_id,
                "side_effect": req.side_effect,
                "args_hash": req.args_hash,
                "snapshot": req.snapshot,
                "owner": owner,
                "owner_boot": boot,
                "owner_pid": pid,
                "lease": req.lease_seconds,
                "executions": executions,
            },
            event,
            req.owner.node,
        )

    def _claim_existing_txn(self, conn: Connection, req: ClaimRequest) -> Claim | None:
        row = conn.execute(
            select(entries, (entries.c.lease_until - db_now()).label("remaining"))
            .where(entries.c.key == req.key)
            .with_for_update()
        ).one_or_none()
        if row is None:
            return None
        found = EntryStatus(row.status)

        def note(event: str, detail: str | None = None) -> None:
            self._append_event(
                conn,
                req.key,
                event,
                task_id=req.task_id,
                fence=row.fence,
                status=row.status,
                actor=req.owner.node,
                detail=detail,
            )

        if row.args_hash != req.args_hash:
            note("conflict", f"args_hash {req.args_hash} != {row.args_hash}")
            return Claim(Gate.CONFLICT, req.key, row.fence, found=found)
        if found.settled:
            note("returned")
            return Claim(
                Gate.RETURN, req.key, row.fence, found=found, result=row.result, error=row.error
            )
        if found is EntryStatus.BLOCKED:
            note("block-gate")
            return Claim(Gate.BLOCK, req.key, row.fence, found=found, reason=row.reason)

        interruptions = row.interruptions
        gate = Gate.TAKEOVER
        if found is EntryStatus.RETRYING:
            gate = Gate.RUN
        elif found is EntryStatus.RUNNING:
            lease_live = row.remaining is not None and row.remaining > 0
            previous_boot = row.owner == req.owner.node and row.owner_boot != req.owner.boot
            if row.owner != RESUME_OWNER:
                if lease_live and not previous_boot:
                    note("waited")
                    return Claim(
                        Gate.WAIT,
                        req.key,
                        row.fence,
                        found=found,
                        lease_remaining=float(row.remaining),
                    )
                interruptions += 1  # the attempt that held it is gone: count the loss here

        if gate is Gate.TAKEOVER and row.executions == 0:
            # A publish intent (or its resume) that no attempt ran yet: a first run, with
            # nothing that could be ambiguous and no crash to count.
            gate = Gate.RUN
        if gate is Gate.TAKEOVER and interruptions > req.max_interruptions:
            reason = (
                f"crash loop: interrupted {interruptions} times "
                f"(ledger_max_resumes={req.max_interruptions})"
            )
            conn.execute(
                update(entries)
                .where(entries.c.key == req.key)
                .values(
                    status=EntryStatus.BLOCKED.value,
                    fence=row.fence + 1,
                    reason=reason,
                    interruptions=interruptions,
                    lease_until=None,
                    updated_at=db_now(),
                )
            )
            self._append_event(
                conn,
                req.key,
                "blocked",
                task_id=req.task_id,
                fence=row.fence + 1,
                status=EntryStatus.BLOCKED.value,
                actor=req.owner.node,
                detail=reason,
            )
            return Claim(Gate.BLOCK, req.key, row.fence + 1, found=found, reason=reason)

        fence = row.fence + 1
        now = db_now()
        conn.execute(
            update(entries)
            .where(entries.c.key == req.key)
            .values(
                status=EntryStatus.RUNNING.value,
                fence=fence,
                task_id=req.task_id,
                snapshot=req.snapshot if req.snapshot is not None else row.snapshot,
                owner=req.owner.node,
                owner_boot=req.owner.boot,
                owner_pid=req.owner.pid,
                lease_until=now + req.lease_seconds,
                executions=entries.c.executions + 1,
                interruptions=interruptions,
                updated_at=now,
            )
        )
        event = (
            "claimed" if row.executions == 0 else "takeover" if gate is Gate.TAKEOVER else "rerun"
        )
        self._append_event(
            conn,
            req.key,
            event,
            task_id=req.task_id,
            fence=fence,
            status=EntryStatus.RUNNING.value,
            actor=req.owner.node,
            detail=f"from {found.value}",
        )
        return Claim(
            gate,
            req.key,
            fence,
            found=found,
            steps=self._load_steps(conn, req.key),
            executions=row.executions,
        )

    def peek_status(self, key: str) -> tuple[EntryStatus, float | None] | None:
        """Read the entry's status and seconds left on its lease (no lock, no write)."""
        with self._read() as conn:
            row = conn.execute(
                select(entries.c.status, (entries.c.lease_until - db_now()).label("left")).where(
                    entries.c.key == key
                )
            ).one_or_none()
        return None if row is None else (EntryStatus(row.status), row.left)

    # -- lease ----------------------------------------------------------------------------

    def renew_lease(self, key: str, fence: int, lease_seconds: float) -> bool:
        """Extend the lease to db-now + ``lease_seconds``, fenced.

        Returns False when the fence moved (superseded) or the entry is no longer running.
        """
        stmt = self.fast.compiled("renew", sql.renew_update)
        with self.fast.cursor() as cur:
            cur.execute(stmt.sql, stmt.params({"k": key, "f": fence, "lease": lease_seconds}))
            return bool(cur.rowcount == 1)

    # -- replay rows ----------------------------------------------------------------------

    def write_step(
        self,
        key: str,
        fence: int,
        ident: tuple[str, str, int],
        *,
        seq: int,
        status: StepStatus,
        output: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Upsert one replay row, fenced on the entry, in one statement.

        ``started`` records intent before an effect; ``completed`` records the output (after
        a ``started`` row or directly for read/idempotent steps); ``not_executed`` records a
        proven non-execution. A completed row is never overwritten. A ``started`` write onto
        an existing row from a new fence, or after a not_executed verdict, counts one more
        attempt of the step's body (``not_executed`` counts one more authorized attempt).
        Returns False when this attempt was superseded, or when the row is completed already
        (nothing is written either way).
        """
        name, ihash, occurrence = ident
        params = {
            "key": key,
            "name": name,
            "input_hash": ihash,
            "occurrence": occurrence,
            "seq": seq,
            "status": status.value,
            "output": output,
            "error": error,
            "fence": fence,
            "authorized": 1 if status is StepStatus.NOT_EXECUTED else 0,
        }
        started = status is StepStatus.STARTED
        stmt = self.fast.compiled(("step", started), lambda: sql.step_upsert(self.dialect, started))
        with self.fast.cursor() as cur:
            cur.execute(stmt.sql, stmt.params(params))
            return cur.fetchone() is not None

    def record_external_ref(
        self, key: str, fence: int, ident: tuple[str, str, int], ref: str
    ) -> bool:
        """Store a provider handle on a started step, fenced. Returns False if superseded."""
        name, ihash, occurrence = ident
        with self._one_statement() as conn:
            res = conn.execute(
                update(steps)
                .where(
                    steps.c.key == key,
                    steps.c.name == name,
                    steps.c.input_hash == ihash,
                    steps.c.occurrence == occurrence,
                    steps.c.key.in_(sql.live_entry(key, fence)),
                )
                .values(external_ref=ref)
            )
        return res.rowcount == 1

    def load_steps(self, key: str) -> tuple[StepRecord, ...]:
        """Every replay row of ``key`` in one query, in execution order."""
        with self._read() as conn:
            return self._load_steps(conn, key)

    # -- settle ---------------------------------------------------------------------------

    def settle(
        self,
        key: str,
        fence: int,
        status: EntryStatus,
        *,
        result: str | None = None,
        error: str | None = None,
        reason: str | None = None,
        actor: str | None = None,
    ) -> bool:
        """Move a running entry to ``status`` (completed, failed, retrying or blocked), fenced.

        Returns False when this attempt was superseded; nothing is written then.
        """
        if status in (EntryStatus.RUNNING, EntryStatus.INTERRUPTED):
            raise ValueError(f"settle cannot move an entry to {status.value}")
        params = {
            "k": key,
            "f": fence,
            "to_status": status.value,
            "new_result": result,
            "new_error": error,
            "new_reason": reason,
        }
        settled = status.settled
        rows = self._fast_with_event(
            ("settle", settled),
            lambda: sql.settle_update(self.dialect, settled),
            params,
            "settled",
            actor,
            reason or error,
        )
        return bool(rows)


def chunked(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
