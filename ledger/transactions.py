"""Transaction steps: the user's writes and the step's ``completed`` row in one transaction.

A transaction step (``self.transaction(name)`` / ``self.transaction_step(name, fn)``) runs
its block on a connection of the ledger's own engine, inside a transaction, and writes the
step's ``completed`` row (with the output, and the children the step sent) on that same
connection before it commits. So:

- the block's writes and the replay row commit together, or neither does: a process that dies
  anywhere inside leaves nothing, and the next attempt runs the block again. There is no
  ``started`` row and no ambiguous window (this is exactly once for writes to the ledger's own
  database, which is the condition: the application's tables live in the ledger's database);
- the row is the hot path's fenced upsert (``statements.step_upsert``): its fence check reads
  the entry ``FOR SHARE`` on PostgreSQL, so a takeover that moves the fence and this commit
  serialize. A zombie's upsert finds the fence moved and writes nothing, and the caller rolls
  the whole transaction back, its writes included. On SQLite the transaction holds the
  database's write lock from its ``BEGIN IMMEDIATE``: nothing interleaves at all;
- one commit per step: the row rides the transaction the block needed anyway, as one more
  statement on the same connection (compiled once, run on its DBAPI cursor).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Integer, String, Text, literal

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.core import StoreCore
from celery_ledger.ledger.dbclock import db_now
from celery_ledger.ledger.errors import translate_db_errors
from celery_ledger.ledger.outbox import Child, child_rows, insert_children
from celery_ledger.ledger.schema import steps
from celery_ledger.ledger.states import StepStatus
from celery_ledger.ledger.values import TRANSACTION_STEP_REF


def _completed_params(
    key: str, fence: int, ident: tuple[str, str, int], seq: int, output: str | None
) -> dict[str, Any]:
    name, ihash, occurrence = ident
    return {
        "key": key,
        "name": name,
        "input_hash": ihash,
        "occurrence": occurrence,
        "seq": seq,
        "status": StepStatus.COMPLETED.value,
        "output": output,
        "error": None,
        "fence": fence,
        "authorized": 0,
    }


@cache
def _marker_insert(dialect: Any) -> Any:
    """A transaction step's marker: its ``started`` row with ``TRANSACTION_STEP_REF``, fenced
    on the entry like ``statements.step_upsert`` (one statement)."""
    B = sql.B  # noqa: N806
    now = db_now()
    values: dict[str, Any] = {
        "key": B("key", String),
        "name": B("name", String),
        "input_hash": B("input_hash", String),
        "occurrence": B("occurrence", Integer),
        "seq": B("seq", Integer),
        "status": literal(StepStatus.STARTED.value, String),
        "external_ref": literal(TRANSACTION_STEP_REF, Text),
        "fence": B("fence", Integer),
        "attempts": literal(1, Integer),
        "authorized": literal(0, Integer),
        "started_at": now,
    }
    source = sql.live_entry(B("key"), B("fence")).with_only_columns(*values.values())
    ins = dialect.insert(steps).from_select(list(values), source)
    return ins.on_conflict_do_update(
        index_elements=[steps.c.key, steps.c.name, steps.c.input_hash, steps.c.occurrence],
        set_={"external_ref": ins.excluded.external_ref, "fence": ins.excluded.fence},
        where=steps.c.status == StepStatus.STARTED.value,
    ).returning(steps.c.fence)


class TransactionSteps(StoreCore):
    """A step's completed row written in a transaction: the transaction step, the outbox."""

    if TYPE_CHECKING:  # from ``HotPath``, with which ``LedgerStore`` combines this class

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
        ) -> bool: ...

    def write_transaction_marker(
        self, key: str, fence: int, ident: tuple[str, str, int], *, seq: int
    ) -> bool:
        """Write a transaction step's marker row (``TRANSACTION_STEP_REF``), fenced, in one
        statement (atomic). Returns False when this attempt was superseded (or the step's row
        is completed already); nothing is written then."""
        name, ihash, occurrence = ident
        stmt = self.fast.compiled("txn-marker", lambda: _marker_insert(self.dialect))
        params = {
            "key": key,
            "name": name,
            "input_hash": ihash,
            "occurrence": occurrence,
            "seq": seq,
            "fence": fence,
        }
        with self.fast.cursor() as cur:
            cur.execute(stmt.sql, stmt.params(params))
            return cur.fetchone() is not None

    @contextmanager
    def step_transaction(self) -> Iterator[Connection]:
        """A connection of the ledger's engine inside a new transaction (``BEGIN IMMEDIATE`` on
        SQLite), for a transaction step's block and its ``complete_on``.

        The caller commits (``conn.commit()``) after ``complete_on`` returned True; anything
        else (an exception, a refused fence, leaving the block) rolls back.

        Raises:
            LedgerUnavailable: the database cannot be reached to begin.
        """
        with translate_db_errors():
            conn = self.engine.connect()
            try:
                conn.begin()
            except BaseException:
                conn.close()
                raise
        try:
            yield conn
        finally:
            # Closing rolls back whatever was not committed.
            with translate_db_errors():
                conn.close()

    # -- record ---------------------------------------------------------------------------

    def complete_step(
        self,
        key: str,
        fence: int,
        ident: tuple[str, str, int],
        *,
        seq: int,
        output: str | None,
        children: Sequence[Child] = (),
    ) -> bool:
        """Write the step's ``completed`` row and record its ``children``, in one transaction
        (atomic), fenced on the entry like ``write_step``: a plain step's completion, and a
        reconciler's ``completed`` verdict with the children the step would have sent.

        Without children this is ``write_step`` (one statement). Not gated (``admission``):
        the row records an effect that happened, it begins none, so a cancellation requested
        meanwhile does not refuse it (it refuses the next ``started`` row). Returns False when
        this attempt was superseded or the row was completed already; no child is recorded
        then.
        """
        if not children:
            return self.write_step(
                key, fence, ident, seq=seq, status=StepStatus.COMPLETED, output=output
            )
        with self._txn() as conn:
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None
            return self.complete_on_dbapi(
                dbapi, key, fence, ident, seq=seq, output=output, children=children, gated=False
            )

    def complete_on(
        self,
        conn: Connection,
        key: str,
        fence: int,
        ident: tuple[str, str, int],
        *,
        seq: int,
        output: str | None,
        children: Sequence[Child] = (),
    ) -> bool:
        """The ``completed`` row and the children on ``conn``, in the caller's transaction.

        The row is the hot path's compiled upsert, run on ``conn``'s own DBAPI cursor: the
        fence check (``statements.live_entry``, share-locked on PostgreSQL until the caller
        commits) and the row are one statement, one round trip. Returns False when the fence
        moved or the row is completed already: the caller must roll back.
        """
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        return self.complete_on_dbapi(
            dbapi, key, fence, ident, seq=seq, output=output, children=children
        )

    def complete_on_dbapi(
        self,
        dbapi: Any,
        key: str,
        fence: int,
        ident: tuple[str, str, int],
        *,
        seq: int,
        output: str | None,
        children: Sequence[Child] = (),
        gated: bool = True,
    ) -> bool:
        """``complete_on`` on a raw DBAPI connection of the same driver as the ledger's, in
        its open transaction (Django's connection inside ``transaction.atomic()``): the same
        compiled statement on another cursor. Returns False when the fence moved, the row is
        completed already, or (``gated``, a transaction step's commit) the admission gate
        refused it (a cancellation is pending, the deadline passed): the caller must roll
        back."""
        name, _, occurrence = ident
        # The gated upsert: a cancellation or a passed deadline refuses the commit as it
        # refuses an effect step's start (``admission``); the caller rolls back either way.
        # Ungated (``complete_step``): the plain completed row, the effect is behind it.
        stmt = self._hot("step-commit" if gated else ("step", False, False))
        params = _completed_params(key, fence, ident, seq, output)
        cur = dbapi.cursor()
        try:
            cur.execute(stmt.sql, stmt.params(params))
            if cur.fetchone() is None:
                return False
            if children:
                ins = self.fast.compiled("outbox-insert", lambda: insert_children(self.dialect))
                cur.executemany(
                    ins.sql,
                    [ins.params(r) for r in child_rows(key, fence, name, occurrence, children)],
                )
        finally:
            cur.close()
        return True

    def commit_step(
        self,
        conn: Connection,
        key: str,
        fence: int,
        ident: tuple[str, str, int],
        *,
        seq: int,
        output: str | None,
        children: Sequence[Child] = (),
    ) -> bool:
        """Write the ``completed`` row (and the children) on ``conn`` and commit the caller's
        ``step_transaction``, fenced: the block's writes and the row commit together.

        One statement for the row and its fence check (``complete_on``), then the commit: the
        block's round trips plus one (children add one more).

        Returns False when the fence moved (nothing committed: the block's writes are rolled
        back with the row).

        Raises:
            LedgerUnavailable: the commit did not reach the database, or its answer was lost.
                Which one is not known here, and need not be: the step's row committed with
                the block's writes or neither did, and the next attempt replays or re-runs
                accordingly.
        """
        if not self.complete_on(conn, key, fence, ident, seq=seq, output=output, children=children):
            return False
        with translate_db_errors():
            conn.commit()
        return True
