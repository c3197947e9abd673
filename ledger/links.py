"""A task's links recorded with its settle: the next chain link and its ``link`` callbacks.

Celery publishes a finished task's next chain link and callbacks from the worker, after the
body returned (``celery.app.trace``). A worker killed between the settle and that publish
loses the rest of the chain unless the message comes back; killed after the publish and before
the ack, the redelivery publishes it again (celery#9835 is the first window with
``worker_deduplicate_successful_tasks``). Recorded here, in the same transaction as the
``completed`` settle, the links are outbox children (``ledger.outbox``): they exist exactly when
the entry completed, and the outbox publishes them once they committed (its sweep if the
worker died first).

The rows use the outbox's table under the step name ``LINKS_STEP``, which a step may not take
(``check_step_name`` reserves it, as it reserves the stepless body's name). Their occurrence is
the fence of the settle that recorded them (``link_task_id``): an entry settles more than once
when an operator releases a failure, and each settle's links are rows of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import or_, select

from celery_ledger.ledger.core import Note, StoreCore, _OnCursor
from celery_ledger.ledger.dialect import Dialect
from celery_ledger.ledger.fastpath import Compiled, FastPath
from celery_ledger.ledger.outbox import Child, child_rows, child_task_id, insert_children
from celery_ledger.ledger.schema import entries, outbox
from celery_ledger.ledger.states import EntryStatus

#: The outbox "step" a settle's links are recorded under.
LINKS_STEP = "__links__"


def link_task_id(key: str, fence: int, n: int) -> str:
    """The task id of the ``n``-th link the settle of ``key`` at ``fence`` records, for a link
    without a frozen id of its own.

    The same on every redelivery that RETURNs that settle (a settle keeps the entry's fence),
    and another one for each settle: a failure's errbacks and, once an operator released it,
    the completed re-run's callbacks never share an id, so neither row hides the other.
    """
    return child_task_id(key, LINKS_STEP, fence, n)


@dataclass(frozen=True)
class Member:
    """An entry in a canvas: published in a group, or by a parent task."""

    key: str
    task_name: str
    task_id: str
    status: EntryStatus
    group_id: str | None
    parent_id: str | None


def link_rows(
    fast: FastPath, dialect: Dialect, key: str, fence: int, links: Sequence[Child]
) -> tuple[Compiled, list[Any]]:
    """The outbox insert (compiled once) and its parameters for the links a settle of
    ``key`` at ``fence`` records (their occurrence is the fence)."""
    record = fast.compiled("outbox-insert", lambda: insert_children(dialect))
    return record, [record.params(r) for r in child_rows(key, fence, LINKS_STEP, fence, links)]


class LinkQueries(StoreCore):
    """The settle that records a task's links."""

    def settle_with_links(
        self,
        key: str,
        fence: int,
        *,
        result: str | None,
        links: Sequence[Child],
        actor: str | None = None,
        status: EntryStatus = EntryStatus.COMPLETED,
        error: str | None = None,
    ) -> bool:
        """Settle a running entry ``completed`` with ``result`` (or ``failed`` with ``error``:
        the links are then its ``link_error`` callbacks) and record ``links`` as its outbox
        children, in one transaction (atomic), fenced like ``settle``.

        Returns False when this attempt was superseded: nothing is written, no link recorded.
        A link id recorded already is left as it is. The rows' occurrence is ``fence``: the
        links of each settle of ``key`` are told apart (``link_task_id``).

        Raises:
            ValueError: no links (that settle is ``settle``, one statement), or a status
                other than completed or failed.
        """
        if not links:
            raise ValueError("settle_with_links without links: use settle")
        if status not in (EntryStatus.COMPLETED, EntryStatus.FAILED):
            raise ValueError(f"a settle records links when completed or failed, not {status}")
        params = {
            "k": key,
            "f": fence,
            "to_status": status.value,
            "new_result": result,
            "new_error": error,
            "new_reason": None,
            "due_in": None,
            "due_abs": None,
            "new_snapshot": None,
        }
        fast = self.fast
        settle = self._hot(("settle", True))
        record, rows_params = link_rows(fast, self.dialect, key, fence, links)
        # The hot path's cursor, as the settle without links: one unit of work. It is a
        # transaction on SQLite already (BEGIN IMMEDIATE); on PostgreSQL its connection is in
        # autocommit, so this unit opens one itself (an error closes the connection, which
        # rolls it back).
        with fast.cursor() as cur:
            if self.dialect.autocommit:
                cur.execute("BEGIN")
            rows = self._write_with_event(
                _OnCursor(self._hot, cur), settle, params, Note("settled", actor)
            )
            if rows:
                cur.executemany(record.sql, rows_params)
            if self.dialect.autocommit:
                cur.execute("COMMIT")
        return bool(rows)

    def members(self, of: str, *, limit: int = 1000) -> list[Member]:
        """The entries published in group ``of`` or by the task ``of`` (its parent), oldest
        first, up to ``limit`` (read-only; both columns are indexed where set)."""
        with self._read() as conn:
            rows = conn.execute(
                select(
                    entries.c.key,
                    entries.c.task_name,
                    entries.c.task_id,
                    entries.c.status,
                    entries.c.group_id,
                    entries.c.parent_id,
                )
                .where(or_(entries.c.group_id == of, entries.c.parent_id == of))
                .order_by(entries.c.created_at, entries.c.key)
                .limit(limit)
            ).all()
        return [
            Member(r.key, r.task_name, r.task_id, EntryStatus(r.status), r.group_id, r.parent_id)
            for r in rows
        ]

    def recorded_links(self, key: str) -> dict[str, bool]:
        """The links recorded with ``key``'s settles (each of them, when an operator released a
        settled failure): child id -> published (read-only)."""
        with self._read() as conn:
            rows = conn.execute(
                select(outbox.c.child_id, outbox.c.published_at).where(
                    outbox.c.parent_key == key, outbox.c.step == LINKS_STEP
                )
            ).all()
        return {child_id: published_at is not None for child_id, published_at in rows}
