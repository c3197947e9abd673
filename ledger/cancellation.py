"""Cancellation and deadlines: what the admission gate (``admission``) writes outside a claim.

- ``request_cancel``: an entry that runs nothing right now settles ``cancelled`` at once; a
  running one is marked, and its next effect step's own write refuses to start
  (``statements.live_entry``); ``finish_cancelled`` settles the marked entries that no attempt
  will settle (interrupted, asleep, or running past its lease), and parks ``blocked`` one whose
  lost attempt left an effect step ``started`` (it may have run).
- ``set_deadline`` / ``stop_reason``: the deadline a claim found, and why a start was refused.
- ``expire_passed``: the gate at recovery's door, for the entries a sweep is about to re-send.

Every transition is a compare-and-set on (key, fence, status) with its audit event, as in
``sweeps``; a lost race returns None/False, never raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, func, select, update

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.admission import earliest, offered_deadline
from celery_ledger.ledger.core import Note, StoreCore
from celery_ledger.ledger.dbclock import db_now, db_now_stable
from celery_ledger.ledger.errors import EntryNotFound
from celery_ledger.ledger.operator_text import check_release_text
from celery_ledger.ledger.schema import CANCEL_PENDING, entries, steps
from celery_ledger.ledger.states import EntryStatus, StepStatus
from celery_ledger.ledger.values import RESUME_OWNER

#: Statuses a cancellation settles at once: nothing runs them right now.
_IDLE = (
    EntryStatus.SCHEDULED.value,
    EntryStatus.SLEEPING.value,
    EntryStatus.RETRYING.value,
    EntryStatus.INTERRUPTED.value,
    EntryStatus.BLOCKED.value,
)
#: Unsettled statuses no attempt runs: a deadline may expire them outside any attempt.
_IDLE_UNSETTLED = (
    EntryStatus.SCHEDULED.value,
    EntryStatus.SLEEPING.value,
    EntryStatus.RETRYING.value,
    EntryStatus.INTERRUPTED.value,
)
B = sql.B


class CancelOutcome:
    """What ``request_cancel`` did: ``cancelled`` (settled now), ``requested`` (the running
    attempt stops at its next effect step), or ``settled`` (too late: it already is)."""

    __slots__ = ("fence", "found", "outcome", "task_id", "task_name")

    def __init__(
        self, outcome: str, found: EntryStatus, fence: int, task_name: str, task_id: str
    ) -> None:
        self.outcome = outcome
        self.found = found
        self.fence = fence
        self.task_name = task_name
        self.task_id = task_id


class CancellationQueries(StoreCore):
    """Queries of the admission gate outside a claim: cancel, finish cancellations, deadlines."""

    # -- cancellation ---------------------------------------------------------------------

    def request_cancel(self, key: str, *, by: str, reason: str, error: str) -> CancelOutcome:
        """Cancel ``key`` durably, in one transaction under its row lock.

        An entry that nothing runs right now (scheduled, sleeping, retrying, interrupted,
        blocked, or running under the resume marker) settles ``cancelled`` with ``error``
        (the encoded ``TaskCancelled``) at once.
        A running one is marked: its attempt's next effect step is refused and the attempt
        settles ``cancelled``; if the attempt is gone, the sweep settles it
        (``finish_cancelled``). A settled entry is left as it is.

        Raises:
            EntryNotFound: no entry has this key.
            OperatorTextError: ``by`` or ``reason`` is blank, too long or not printable (the
                rules of a release, ``check_release_text``); nothing is read or written.
        """
        check_release_text(by, reason, action="cancel")
        with self._txn() as conn:
            row = conn.execute(
                select(entries).where(entries.c.key == key).with_for_update()
            ).one_or_none()
            if row is None:
                raise EntryNotFound(f"no ledger entry with key {key}")
            found = EntryStatus(row.status)
            if found.settled:
                return CancelOutcome("settled", found, row.fence, row.task_name, row.task_id)
            now = db_now()
            values: dict[str, Any] = {
                "cancel_requested_at": func.coalesce(entries.c.cancel_requested_at, now),
                "cancel_by": by,
                "cancel_reason": reason,
                "updated_at": now,
            }
            outcome = "requested"
            # Under the resume marker nothing runs it either: a publish intent, or an entry
            # the sweep re-sent (its claim waits for this row lock, then finds it settled).
            if found.value in _IDLE or row.owner == RESUME_OWNER:
                outcome = "cancelled"
                values.update(_cancelled_values(row.fence + 1, error))
            upd = (
                update(entries)
                .where(entries.c.key == key, entries.c.fence == row.fence)
                .values(**values)
                .returning(*sql.RETURNED)
            )
            event = "cancelled" if outcome == "cancelled" else "cancel-requested"
            self._write_with_event(
                conn, sql.with_event(self.dialect, upd), {}, Note(event, by, reason)
            )
            fence = row.fence + 1 if outcome == "cancelled" else row.fence
            return CancelOutcome(outcome, found, fence, row.task_name, row.task_id)

    def finish_cancelled(self, error: str, *, limit: int = 500, actor: str = "sweep") -> int:
        """Finish the pending cancellations that no live attempt will carry out: the entry is
        interrupted, retrying, asleep or held, or running with an expired lease. One
        transaction over the pending-cancellation index. Returns how many it finished.

        Each is settled ``cancelled`` (fence + 1, the stored ``error``), except an entry with
        an effect step ``started`` and no outcome: that step may have run, so the entry is
        parked ``blocked`` with a reason that says so (``_park_cancelled``).

        Every write is a compare-and-set that re-checks, in its own WHERE, what the pick
        found: the fence, the pending cancellation, a status it finishes, and for a running
        entry an expired lease. An attempt that settles (``completed``) or renews its lease
        between the pick and the write wins; the entry is left as that attempt wrote it
        (PostgreSQL re-evaluates the WHERE on the row version the attempt committed).
        """
        first_started = (
            select(func.min(steps.c.name))
            .where(steps.c.key == entries.c.key, steps.c.status == StepStatus.STARTED.value)
            .correlate(entries)
            .scalar_subquery()
        )
        with self._txn() as conn:
            ambiguous = conn.execute(
                select(
                    entries.c.key,
                    entries.c.fence,
                    entries.c.cancel_by,
                    entries.c.cancel_reason,
                    first_started.label("step"),
                )
                .where(*_unattended_cancel(), first_started.is_not(None))
                .limit(limit)
            ).all()
            parked = sum(self._park_cancelled(conn, row, actor) for row in ambiguous)
            picked = (
                select(entries.c.key, entries.c.fence.label("picked_fence"))
                .where(*_unattended_cancel(), first_started.is_(None))
                .limit(limit)
                .cte("picked")
                .prefix_with("MATERIALIZED", dialect="postgresql")
            )
            upd = (
                update(entries)
                .where(
                    entries.c.key == picked.c.key,
                    entries.c.fence == picked.c.picked_fence,
                    *_unattended_cancel(),
                )
                .values(**_cancelled_values(entries.c.fence + 1, error))
                .returning(*sql.RETURNED)
            )
            rows = self._write_with_event(
                conn,
                sql.with_event(self.dialect, upd),
                {},
                Note("cancelled", actor, "cancellation pending, no live attempt"),
            )
        return parked + len(rows)

    def _park_cancelled(self, conn: Connection, row: Any, actor: str) -> int:
        """Park ``blocked`` one pending cancellation whose lost attempt started an effect step
        (``row.step``) and recorded no outcome; a CAS as in ``finish_cancelled``. Returns 1,
        or 0 when the entry moved meanwhile.

        Why blocked, not ``cancelled`` with a note: a cancelled entry is settled, so every
        later delivery raises ``TaskCancelled`` and ``release`` refuses it; nothing would ever
        say whether the step ran, though it may have (a charge made, then the worker lost).
        A blocked entry is what an operator acts on: ``show`` prints this reason, ``release
        --verified completed`` records that the step ran, ``--verified not-executed`` lets it
        run again, where the still-pending cancellation refuses its first effect step and the
        attempt settles ``cancelled``; a second ``cancel`` settles it as it stands.
        """
        reason = (
            f"cancellation asked by {row.cancel_by or 'an operator'} ({row.cancel_reason or ''})"
            f" after step {row.step!r} started: step {row.step!r} may have executed (its "
            "attempt was lost with no outcome recorded); check whether it ran "
            f"(celery-ledger show {row.key}), then release it (--verified completed or "
            "not-executed) or cancel it again"
        )
        upd = (
            update(entries)
            .where(entries.c.key == row.key, entries.c.fence == row.fence, *_unattended_cancel())
            .values(
                status=EntryStatus.BLOCKED.value,
                fence=row.fence + 1,
                reason=reason,
                lease_until=None,
                due_at=None,
                updated_at=db_now(),
            )
            .returning(*sql.RETURNED)
        )
        note = Note("blocked", actor, reason)
        return len(self._write_with_event(conn, sql.with_event(self.dialect, upd), {}, note))

    # -- deadlines ------------------------------------------------------------------------

    def set_deadline(
        self, key: str, fence: int, *, at: float | None, after_created: float | None
    ) -> bool | None:
        """Offer the attempt a deadline (the earlier of ``at`` and created_at +
        ``after_created``), fenced, in one statement; the stored one only ever moves earlier
        (``admission.earliest``). Returns whether it already passed on the database clock;
        None when the fence moved."""
        offered = offered_deadline(entries.c.created_at, B("abs"), B("rel"))
        upd = (
            update(entries)
            .where(
                entries.c.key == key,
                entries.c.fence == fence,
                entries.c.status == EntryStatus.RUNNING.value,
            )
            .values(deadline_at=earliest(entries.c.deadline_at, offered))
            # Compared here, not in RETURNING (``statements.claim_insert`` says why).
            .returning(entries.c.deadline_at, db_now().label("now"))
        )
        with self._one_statement() as conn:
            row = conn.execute(upd, {"abs": at, "rel": after_created}).first()
        if row is None:
            return None
        return row.deadline_at is not None and row.deadline_at <= row.now

    def stop_reason(self, key: str, fence: int) -> str | None:
        """Why an effect step of the attempt at ``fence`` was refused: ``cancelled``,
        ``expired``, or None (the fence moved: superseded). Read-only."""
        with self._read() as conn:
            row = conn.execute(
                select(
                    entries.c.cancel_requested_at,
                    (entries.c.deadline_at <= db_now()).label("passed"),
                ).where(
                    entries.c.key == key,
                    entries.c.fence == fence,
                    entries.c.status == EntryStatus.RUNNING.value,
                )
            ).first()
        if row is None:
            return None
        if row.cancel_requested_at is not None:
            return EntryStatus.CANCELLED.value
        if row.passed:
            return EntryStatus.EXPIRED.value
        return None

    def expire_passed(self, keys: Sequence[str], error: str, *, actor: str = "sweep") -> set[str]:
        """Settle ``expired`` (fence + 1, ``error``) those of ``keys`` whose deadline passed on
        the database clock and that no live attempt holds: the entries a sweep is about to
        send again (interrupted, a lost intent, an overdue retry, a due wake). The admission
        gate at recovery's door: what a claim would refuse is never re-sent, so a message
        Celery discarded as expired is not sent back forever.

        One statement over the given keys (their primary key: no scan). The predicate is the
        safety argument, so no fence is compared: an entry whose deadline passed and that no
        attempt runs may be expired whatever its fence; a claim that takes it concurrently
        holds its row lock, and the re-checked ``WHERE`` then finds it run by an owner with
        a live lease. Returns the keys it settled.
        """
        if not keys:
            return set()
        idle = (EntryStatus.RUNNING.value,) + _IDLE_UNSETTLED
        upd = (
            update(entries)
            .where(
                entries.c.key.in_(bindparam("keys", expanding=True)),
                entries.c.deadline_at <= db_now(),
                entries.c.status.in_(idle),
                (entries.c.status != EntryStatus.RUNNING.value)
                | (entries.c.owner == RESUME_OWNER)
                | (entries.c.lease_until < db_now()),
            )
            .values(**_settled_values(EntryStatus.EXPIRED, entries.c.fence + 1, error))
            .returning(*sql.RETURNED)
        )
        with self._txn() as conn:
            rows = self._write_with_event(
                conn,
                sql.with_event(self.dialect, upd),
                {"keys": list(keys)},
                Note("expired", actor, "deadline passed before it could be sent again"),
            )
        return {r[0] for r in rows}


def _unattended_cancel() -> list[Any]:
    """An entry with a pending cancellation that no live attempt will carry out: the statuses
    ``finish_cancelled`` finishes, and a running one only past its lease on the database
    clock. Used by the pick and again in each write's WHERE (the compare-and-set)."""
    return [
        entries.c.cancel_requested_at.is_not(None),
        entries.c.status.in_(CANCEL_PENDING),
        (entries.c.status != EntryStatus.RUNNING.value) | (entries.c.lease_until < db_now_stable()),
    ]


def _cancelled_values(fence: Any, error: str) -> dict[str, Any]:
    return _settled_values(EntryStatus.CANCELLED, fence, error)


def _settled_values(status: EntryStatus, fence: Any, error: str) -> dict[str, Any]:
    now = db_now()
    return {
        "status": status.value,
        "fence": fence,
        "error": error,
        "lease_until": None,
        "due_at": None,
        "settled_at": now,
        "updated_at": now,
    }


__all__ = ["CancelOutcome", "CancellationQueries"]
