"""The transactional outbox: child tasks recorded with the step that sends them.

A step that sends a task (``self.send(sig)``) does not publish it. The message is recorded
here, in the same transaction as the step's ``completed`` row, and published after that row
commits:

- a crash before the commit leaves neither the row nor the message: the step runs again and
  sends again, under the same child id;
- a crash after the commit, before the publish, leaves a row with ``published_at`` NULL: the
  sweep publishes it (``unpublished``), and marks it after the broker confirmed
  (``mark_published``);
- a crash after the publish, before the mark, publishes it once more: the child id is
  deterministic (``child_task_id``), so the second message is the same task id and the child's
  own claim returns or waits instead of running twice.

The primitive is three operations, each one transaction: **record** (``complete_step`` /
``complete_on`` in ``ledger.transactions``, atomic with the step's completed row), **list**
what is unpublished (``unpublished``), **mark** what the broker took (``mark_published``).
Publishing is the caller's (it needs Celery: ``celery_ledger.recovery.outbox``).

A child whose publish fails for a fault of its own (an option no publish can send, recorded
before ``send()`` checked them) is **noted** (``note_publish_failures``): counted, its error
kept, and listed after every child with fewer failures, so that it never holds back the others.
An operator **drops** it (``drop_child``) or **repairs** its payload (``repair_child``); each
is one transaction with an audit event on the parent entry.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, String, Text, delete, func, insert, select, update

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.core import StoreCore
from celery_ledger.ledger.dbclock import db_now
from celery_ledger.ledger.errors import EntryNotFound, ReleaseRefused
from celery_ledger.ledger.operator_text import check_release_text
from celery_ledger.ledger.schema import entries, events, outbox

#: Longest ``last_error`` kept for a child (one line of a driver's or Celery's words).
MAX_PUBLISH_ERROR_CHARS = 500

#: The uuid5 namespace of child task ids (fixed forever: changing it changes every child id).
CHILD_NAMESPACE = uuid.UUID("6f0c7f43-2b4e-5d8a-9a51-1c6f4f0d2e16")


def child_task_id(parent_key: str, step: str, occurrence: int, n: int) -> str:
    """The task id of the ``n``-th child sent by step ``step`` (its ``occurrence``) of
    ``parent_key``: the same on every run of that step, so a re-publish is the same task."""
    return str(uuid.uuid5(CHILD_NAMESPACE, f"{parent_key}\x1f{step}\x1f{occurrence}\x1f{n}"))


@dataclass(frozen=True)
class Child:
    """A child message a step sends: what the outbox records."""

    child_id: str
    task_name: str
    #: kombu JSON of {"args": [...], "kwargs": {...}, "options": {...}}.
    payload: str
    #: The n-th send inside its step run (0-based).
    n: int


@dataclass(frozen=True)
class OutboxMessage:
    """A recorded child, as the outbox holds it."""

    child_id: str
    parent_key: str
    step: str
    occurrence: int
    n: int
    task_name: str
    payload: str
    fence: int
    created_at: float
    #: When the broker confirmed it, or an operator dropped it (``dropped_reason``).
    published_at: float | None
    #: Publishes that failed for a fault of the child's own, and the last one's error.
    publish_errors: int = 0
    last_error: str | None = None
    #: An operator dropped it: who and why.
    dropped_reason: str | None = None

    @property
    def published(self) -> bool:
        return self.published_at is not None

    @property
    def state(self) -> str:
        """``sent``, ``dropped``, ``failing`` (pending, its publish failed) or ``pending``."""
        if self.dropped_reason is not None:
            return "dropped"
        if self.published:
            return "sent"
        return "failing" if self.publish_errors else "pending"


def child_rows(
    parent_key: str, fence: int, step: str, occurrence: int, children: Iterable[Child]
) -> list[dict[str, Any]]:
    return [
        {
            "child_id": c.child_id,
            "parent_key": parent_key,
            "step": step,
            "occurrence": occurrence,
            "n": c.n,
            "task_name": c.task_name,
            "payload": c.payload,
            "fence": fence,
        }
        for c in children
    ]


def insert_children(dialect: Any) -> Any:
    """Record children; a child id already recorded is left as it is (a replayed send)."""
    B = sql.B  # noqa: N806
    return (
        dialect.insert(outbox)
        .values(
            child_id=B("child_id", String),
            parent_key=B("parent_key", String),
            step=B("step", String),
            occurrence=B("occurrence", Integer),
            n=B("n", Integer),
            task_name=B("task_name", String),
            payload=B("payload", Text),
            fence=B("fence", Integer),
            created_at=db_now(),
        )
        .on_conflict_do_nothing(index_elements=[outbox.c.child_id])
    )


class OutboxQueries(StoreCore):
    """List and mark the children steps recorded; show them to operators."""

    # -- publish: list and mark -----------------------------------------------------------

    def unpublished(self, *, limit: int = 500, older_than: float = 0.0) -> list[OutboxMessage]:
        """Up to ``limit`` recorded children not yet marked published, recorded at least
        ``older_than`` seconds ago (read-only): the fewest failed publishes first, then the
        oldest, so a child that fails every time never keeps the others out of the batch. The
        runtime publishes a child right after its commit; the grace keeps the sweep from
        publishing it a second time meanwhile (harmless, since the child's claim deduplicates
        it, but wasted)."""
        with self._read() as conn:
            rows = conn.execute(
                select(outbox)
                .where(
                    outbox.c.published_at.is_(None),
                    outbox.c.created_at <= db_now() - older_than,
                )
                .order_by(outbox.c.publish_errors, outbox.c.created_at)
                .limit(limit)
            ).all()
        return [_message(r) for r in rows]

    def mark_published(self, child_ids: Sequence[str]) -> int:
        """Mark children published (the broker confirmed them), in one statement (atomic).

        Returns how many were unmarked before; marking one twice is harmless.
        """
        if not child_ids:
            return 0
        with self._one_statement() as conn:
            res = conn.execute(
                update(outbox)
                .where(outbox.c.child_id.in_(list(child_ids)), outbox.c.published_at.is_(None))
                .values(published_at=db_now())
            )
        return int(res.rowcount or 0)

    def note_publish_failures(self, failures: Sequence[tuple[str, str]]) -> int:
        """Count one failed publish of each (child id, error), keeping the error; one
        transaction. A child published or dropped meanwhile is left alone. Returns how many
        were noted."""
        if not failures:
            return 0
        noted = 0
        with self._txn() as conn:
            for child_id, error in failures:
                res = conn.execute(
                    update(outbox)
                    .where(outbox.c.child_id == child_id, outbox.c.published_at.is_(None))
                    .values(
                        publish_errors=outbox.c.publish_errors + 1,
                        last_error=error[:MAX_PUBLISH_ERROR_CHARS],
                    )
                )
                noted += int(res.rowcount or 0)
        return noted

    # -- operators ------------------------------------------------------------------------

    def drop_child(self, parent_key: str, child_id: str, *, by: str, reason: str) -> OutboxMessage:
        """Drop a pending child: the outbox stops owing it, and it is never published; one
        transaction, with a ``child-dropped`` event on the parent entry.

        Raises:
            OperatorTextError: ``by`` or ``reason`` is blank, too long or not printable.
            EntryNotFound: ``parent_key`` recorded no child ``child_id``.
            ReleaseRefused: the child was published (or dropped) already.
        """
        check_release_text(by, reason, action="outbox drop")
        with self._txn() as conn:
            found = self._pending_child(conn, parent_key, child_id, "drop")
            conn.execute(
                update(outbox)
                .where(outbox.c.child_id == child_id)
                .values(published_at=db_now(), dropped_reason=f"{by}: {reason}")
            )
            self._child_event(conn, found, "child-dropped", by, reason)
            row = conn.execute(select(outbox).where(outbox.c.child_id == child_id)).one()
        return _message(row)

    def repair_child(
        self, parent_key: str, child_id: str, payload: str, *, by: str, reason: str
    ) -> OutboxMessage:
        """Replace a pending child's payload (the caller built it: an option cleared) and
        forget its failed publishes, so the next sweep publishes it first; one transaction,
        with a ``child-repaired`` event on the parent entry. Its task id stays: a copy that
        went out after all is deduplicated by a ledgered child's claim.

        Raises:
            OperatorTextError: ``by`` or ``reason`` is blank, too long or not printable.
            EntryNotFound: ``parent_key`` recorded no child ``child_id``.
            ReleaseRefused: the child was published (or dropped) already.
        """
        check_release_text(by, reason, action="outbox repair")
        with self._txn() as conn:
            found = self._pending_child(conn, parent_key, child_id, "repair")
            conn.execute(
                update(outbox)
                .where(outbox.c.child_id == child_id)
                .values(payload=payload, publish_errors=0, last_error=None)
            )
            self._child_event(conn, found, "child-repaired", by, reason)
            row = conn.execute(select(outbox).where(outbox.c.child_id == child_id)).one()
        return _message(row)

    def _pending_child(self, conn: Any, parent_key: str, child_id: str, action: str) -> Any:
        row = conn.execute(
            select(outbox)
            .where(outbox.c.child_id == child_id, outbox.c.parent_key == parent_key)
            .with_for_update()
        ).one_or_none()
        if row is None:
            raise EntryNotFound(f"entry {parent_key} recorded no child {child_id}")
        if row.published_at is not None:
            done = "dropped" if row.dropped_reason is not None else "published"
            raise ReleaseRefused(
                f"child {child_id} was {done} already; there is nothing to {action}"
            )
        return row

    def _child_event(self, conn: Any, child: Any, event: str, by: str, reason: str) -> None:
        """The audit event of an operator's action on a child, on its parent entry (if the
        entry is still there: a pruned parent's children are still owed)."""
        parent = conn.execute(
            select(entries.c.task_id, entries.c.fence, entries.c.status).where(
                entries.c.key == child.parent_key
            )
        ).one_or_none()
        if parent is None:
            return
        conn.execute(
            insert(events).values(
                key=child.parent_key,
                task_id=parent.task_id,
                fence=parent.fence,
                event=event,
                status=parent.status,
                actor=by,
                detail=f"child {child.child_id} ({child.task_name}, step {child.step}): {reason}",
                at=db_now(),
            )
        )

    def children_of(self, parent_key: str) -> list[OutboxMessage]:
        """The children ``parent_key``'s steps recorded, in the order they were sent."""
        with self._read() as conn:
            rows = conn.execute(
                select(outbox)
                .where(outbox.c.parent_key == parent_key)
                .order_by(outbox.c.created_at, outbox.c.occurrence, outbox.c.n)
            ).all()
        return [_message(r) for r in rows]

    def parent_of(self, child_id: str) -> OutboxMessage | None:
        """The outbox row that sent the task ``child_id``, if a step sent it."""
        with self._read() as conn:
            row = conn.execute(select(outbox).where(outbox.c.child_id == child_id)).one_or_none()
        return None if row is None else _message(row)

    def count_unpublished(self) -> int:
        """How many recorded children wait for their publish (index-only)."""
        with self._read() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(outbox).where(outbox.c.published_at.is_(None))
                ).scalar_one()
            )

    def count_failing(self) -> int:
        """How many unpublished children failed to publish for a fault of their own (they
        wait for an operator's drop or repair; index-only)."""
        with self._read() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(outbox)
                    .where(outbox.c.published_at.is_(None), outbox.c.publish_errors > 0)
                ).scalar_one()
            )

    def prune_outbox(self, *, limit: int = 1000) -> int:
        """Delete published children whose parent entry is gone (pruned), one transaction.

        An unpublished child is never deleted: it is work the sweep still owes.
        """
        orphan = (
            select(outbox.c.child_id)
            .where(
                outbox.c.published_at.is_not(None),
                ~select(entries.c.key).where(entries.c.key == outbox.c.parent_key).exists(),
            )
            .limit(limit)
        )
        with self._txn() as conn:
            ids = [i for (i,) in conn.execute(orphan)]
            if ids:
                conn.execute(delete(outbox).where(outbox.c.child_id.in_(ids)))
        return len(ids)


def _message(r: Any) -> OutboxMessage:
    return OutboxMessage(
        child_id=r.child_id,
        parent_key=r.parent_key,
        step=r.step,
        occurrence=r.occurrence,
        n=r.n,
        task_name=r.task_name,
        payload=r.payload,
        fence=r.fence,
        created_at=r.created_at,
        published_at=r.published_at,
        publish_errors=r.publish_errors,
        last_error=r.last_error,
        dropped_reason=r.dropped_reason,
    )
