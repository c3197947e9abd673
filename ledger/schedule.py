"""Durable time (design.md § "Durable time"): entries the ledger holds until a due time.

- ``schedule``: a long countdown or ETA is an entry ``scheduled`` with its due time and
  argument snapshot; no broker holds a message for it.
- ``list_due`` / ``begin_wake``: the sweep finds ``scheduled`` and ``sleeping`` entries whose
  due time passed (the due-time index of 0002: a range scan over what is due, never over what
  is held) and hands each to exactly one waker, which re-sends it with its task id.
- ``prune_tombstones`` / ``tombstone_values``: what a pruned entry keeps, and for how long.

Cancellation and deadlines, which stop a held entry as they stop a running one, are
``cancellation`` (``CancellationQueries``).

Every transition is a compare-and-set on (key, fence, status) with its audit event, as in
``sweeps``; a lost race returns None/False, never raises.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Float,
    String,
    case,
    cast,
    delete,
    func,
    select,
    update,
)

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.admission import (
    PRUNED_FAILURE,
    cancelled_failure,
    offered_deadline,
)
from celery_ledger.ledger.cancellation import CancelOutcome
from celery_ledger.ledger.core import Note, StoreCore
from celery_ledger.ledger.dbclock import db_now, db_now_stable
from celery_ledger.ledger.schema import entries, steps
from celery_ledger.ledger.states import EntryStatus, StepStatus
from celery_ledger.ledger.values import RESUME_OWNER, ClaimRequest, Resuming

_WAITING = (EntryStatus.SCHEDULED.value, EntryStatus.SLEEPING.value)

#: The step a durable sleep records (``self.sleep``): its output is the wake time, so a
#: resumed body never sleeps twice. A sleep woken by hand (``begin_wake(only_due=False)``)
#: gets the time it was woken as its output, so the replay ends the sleep there.
SLEEP_STEP = "ledger.sleep"

B = sql.B


def _end_sleep(key: str) -> Any:
    """Set the output of ``key``'s last step, when it is a completed sleep, to now (the
    database clock, as the sleep's own wake time; a JSON number either way)."""
    last = select(func.max(steps.c.seq)).where(steps.c.key == key).scalar_subquery()
    return (
        update(steps)
        .where(
            steps.c.key == key,
            steps.c.name == SLEEP_STEP,
            steps.c.status == StepStatus.COMPLETED.value,
            steps.c.seq == last,
        )
        .values(output=cast(db_now(), String))
    )


class Due:
    """One waiting entry the sweep found due."""

    __slots__ = ("due_at", "fence", "key", "status", "task_id", "task_name")

    def __init__(
        self, key: str, task_name: str, task_id: str, fence: int, status: str, due_at: float
    ) -> None:
        self.key = key
        self.task_name = task_name
        self.task_id = task_id
        self.fence = fence
        self.status = EntryStatus(status)
        self.due_at = due_at


class ScheduleQueries(StoreCore):
    """Queries of durable time: schedule, wake, tombstones."""

    def schedule(
        self,
        req: ClaimRequest,
        *,
        due_in: float | None = None,
        due_at: float | None = None,
        deadline_at: float | None = None,
        deadline_in: float | None = None,
    ) -> bool:
        """Record a task the ledger holds until its due time (``due_in`` seconds from now on
        the database clock, or ``due_at``), in one statement with its ``scheduled`` event.
        Its deadline is the earlier of ``deadline_at`` (absolute) and ``deadline_in`` seconds
        from now on the database clock, the clock its due time is on.

        Returns False when the key has an entry already (nothing written).
        """
        now = db_now()
        ins = (
            self.dialect.insert(entries)
            .values(
                key=req.key,
                task_name=req.task_name,
                task_id=req.task_id,
                status=EntryStatus.SCHEDULED.value,
                fence=1,
                side_effect=req.side_effect,
                args_hash=req.args_hash,
                snapshot=req.snapshot,
                owner=RESUME_OWNER,
                executions=0,
                interruptions=0,
                created_at=now,
                updated_at=now,
                due_at=func.coalesce(now + B("due_in", Float), B("due_abs", Float)),
                deadline_at=offered_deadline(now, B("deadline_abs"), B("deadline_in")),
            )
            .on_conflict_do_nothing(index_elements=[entries.c.key])
            .returning(*sql.RETURNED)
        )
        params = {
            "due_in": due_in,
            "due_abs": due_at,
            "deadline_abs": deadline_at,
            "deadline_in": deadline_in,
        }
        with self._one_statement() as conn:
            rows = self._write_with_event(
                conn, sql.with_event(self.dialect, ins), params, Note("scheduled", None)
            )
        return bool(rows)

    def list_due(self, *, limit: int = 500) -> list[Due]:
        """``scheduled`` and ``sleeping`` entries whose due time passed on the database clock,
        most overdue first (read-only). The due-time index's range ``due_at < now`` holds only
        what is due: the cost grows with the entries due, not with those held."""
        with self._read() as conn:
            rows = conn.execute(
                select(
                    entries.c.key,
                    entries.c.task_name,
                    entries.c.task_id,
                    entries.c.fence,
                    entries.c.status,
                    entries.c.due_at,
                )
                .where(entries.c.due_at < db_now_stable(), entries.c.status.in_(_WAITING))
                .order_by(entries.c.due_at)
                .limit(limit)
            ).all()
        return [Due(r.key, r.task_name, r.task_id, r.fence, r.status, r.due_at) for r in rows]

    def begin_wake(
        self,
        key: str,
        fence: int,
        status: EntryStatus,
        *,
        lease_seconds: float,
        actor: str = "sweep",
        only_due: bool = True,
    ) -> tuple[Resuming, float | None] | None:
        """CAS a ``scheduled``/``sleeping`` entry at ``fence`` to ``running`` under the resume
        marker (fence + 1, lease ``lease_seconds``), returning what the winner re-sends and
        the entry's deadline (sent along, so that the claim checks it at once).

        The entry keeps its due time until a claim hands it to an attempt: the mark that
        its last attempt (a held ``self.retry``, a sleep) ended cleanly and none has run
        since. The claim of the re-sent message RUNs it (nothing executed yet, or completed
        steps replay as for a ``retrying`` entry), never takes it over; if the message is
        lost, the lease expires and the stale-lease sweep resumes it like any interrupted
        entry, and that claim RUNs it too (the due time is still there). ``only_due``: only
        if its due time passed (``resume`` by hand passes False). An entry with a pending
        cancellation is not woken (``finish_cancelled`` settles it). Exactly one of any
        number of concurrent wakers gets a ``Resuming``.
        """
        completed = (
            select(func.count())
            .where(steps.c.key == key, steps.c.status == StepStatus.COMPLETED.value)
            .scalar_subquery()
            .label("completed_steps")
        )
        cond = [
            entries.c.key == key,
            entries.c.fence == fence,
            entries.c.status == status.value,
            entries.c.cancel_requested_at.is_(None),
        ]
        if only_due:
            cond.append(entries.c.due_at < db_now())
        upd = (
            update(entries)
            .where(*cond)
            .values(
                status=EntryStatus.RUNNING.value,
                fence=fence + 1,
                owner=RESUME_OWNER,
                owner_boot=None,
                owner_pid=None,
                lease_until=db_now() + lease_seconds,
                # The due time stays, as the mark of a clean settle that no attempt has run
                # since: the claim of the wake re-runs it (``claim_gates._run_gate``).
                updated_at=db_now(),
            )
            .returning(
                *sql.RETURNED,
                entries.c.task_name,
                entries.c.snapshot,
                entries.c.deadline_at,
                completed,
            )
        )
        if only_due or status is not EntryStatus.SLEEPING:
            with self._one_statement() as conn:
                note = Note("woken", actor, f"{status.value}: due")
                rows = self._write_with_event(conn, sql.with_event(self.dialect, upd), {}, note)
        else:
            # Woken by hand before its wake time: the sleep the entry is in ends now. Its step
            # (the entry's last: the attempt settled ``sleeping`` right after it) replays the
            # time of this wake, else the resumed body would sleep again until the old one.
            with self._txn() as conn:
                note = Note("woken", actor, "sleeping: woken by hand before its wake time")
                rows = self._write_with_event(conn, sql.with_event(self.dialect, upd), {}, note)
                if rows:
                    conn.execute(_end_sleep(key))
        if not rows:
            return None
        row = rows[0]
        won = Resuming.from_row(row)
        return won, row.deadline_at

    def prune_tombstones(self, older_than_seconds: float, *, limit: int = 1000) -> int:
        """Delete up to ``limit`` tombstones settled longer ago than the window (their index's
        range; one transaction). Returns how many."""
        picked = (
            select(entries.c.key)
            .where(
                entries.c.tombstone_at.is_not(None),
                entries.c.tombstone_at < db_now_stable() - older_than_seconds,
            )
            .order_by(entries.c.tombstone_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        with self._txn() as conn:
            keys = [k for (k,) in conn.execute(picked)]
            if keys:
                conn.execute(
                    delete(entries).where(
                        entries.c.key.in_(keys), entries.c.tombstone_at.is_not(None)
                    )
                )
        return len(keys)

    def keys_of_task_id(self, task_id: str, *, limit: int = 5) -> list[str]:
        """Keys whose entry holds ``task_id`` (its index; read-only)."""
        with self._read() as conn:
            return [
                k
                for (k,) in conn.execute(
                    select(entries.c.key).where(entries.c.task_id == task_id).limit(limit)
                )
            ]


def tombstone_values(error: str) -> dict[str, Any]:
    """What a tombstone keeps of a settled entry: key, task, arguments hash, final status,
    settled time (``tombstone_at``). A completed one returns nothing (no result is kept); any
    other raises ``error`` to a late delivery."""
    return {
        "tombstone_at": entries.c.settled_at,
        "settled_at": None,
        "result": None,
        "snapshot": None,
        "reason": None,
        "cancel_reason": None,
        "error": case((entries.c.status == EntryStatus.COMPLETED.value, None), else_=error),
    }


__all__ = [
    "PRUNED_FAILURE",
    "CancelOutcome",
    "Due",
    "ScheduleQueries",
    "cancelled_failure",
    "tombstone_values",
]
