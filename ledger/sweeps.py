"""Recovery's queries: find and mark interrupted work, hand it to exactly one resumer, prune.

Every query is bounded (``limit``), driven by a partial index (``status = 'running'`` by
lease or by owner, the attention index, ``settled_at``), and safe to run from several sweepers
at once: each transition is a compare-and-set on (key, fence, status), so of two sweepers that
race for one entry, one wins and the other's update matches nothing. A lost race returns
nothing for that entry (an empty list, None or False); it never raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    Select,
    String,
    any_,
    bindparam,
    case,
    delete,
    func,
    literal_column,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.core import Note, StoreCore
from celery_ledger.ledger.crashloop import CrashLoop, crash_loop_reason
from celery_ledger.ledger.dbclock import db_now, db_now_stable
from celery_ledger.ledger.schedule import tombstone_values
from celery_ledger.ledger.schema import entries, events, rate_holds, signals, steps
from celery_ledger.ledger.states import EntryStatus, StepStatus
from celery_ledger.ledger.values import RESUME_OWNER, Interrupted, Overdue, Resuming

_RUNNING = EntryStatus.RUNNING.value
_INTERRUPTED = EntryStatus.INTERRUPTED.value
_RETRYING = EntryStatus.RETRYING.value


class SweepQueries(StoreCore):
    """Queries for the boot sweep, the stale-lease sweep, resume and retention."""

    def interrupt_expired(self, *, limit: int = 500, actor: str = "sweep") -> list[Interrupted]:
        """Mark running entries whose lease expired on the database clock ``interrupted``.

        The fence is bumped in the same statement, so an attempt that was only paused (SIGSTOP,
        a long GC, a partition) and wakes up later finds every write refused.
        Atomic per call (one transaction); fenced per entry on (key, running). Returns the
        entries this call marked (not those another sweeper marked first, nor rows it holds
        locked: SKIP LOCKED on PostgreSQL; on SQLite no other writer runs at all).
        """
        with self._txn() as conn:
            keys = (
                select(entries.c.key)
                .where(
                    entries.c.status == _RUNNING,
                    entries.c.lease_until < db_now_stable(),
                )
                .order_by(entries.c.lease_until)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
            return self._interrupt(conn, keys, actor, "lease expired")

    def interrupt_previous_boot(
        self, node: str, boot: str, *, limit: int = 1000, actor: str | None = None
    ) -> list[Interrupted]:
        """Mark entries still running under ``node`` from a boot other than ``boot`` interrupted.

        A worker calls this when it is ready: it knows its previous process is gone, so it
        need not wait for those leases to expire. Atomic per call (one transaction), fenced
        per entry on (key, running). Returns the entries this call marked.
        """
        with self._txn() as conn:
            keys = (
                select(entries.c.key)
                .where(
                    entries.c.status == _RUNNING,
                    entries.c.owner == node,
                    entries.c.owner_boot != boot,
                )
                .limit(limit)
            )
            # Its previous boot is gone: a death signal, as the fast path's (``_interrupt``).
            why = f"previous boot of {node}"
            return self._interrupt(conn, keys, actor or node, why, dead=True)

    def interrupt_owner(
        self, key: str, *, node: str, boot: str, pid: int | None, actor: str, why: str
    ) -> Interrupted | None:
        """Mark ``key`` interrupted if it is still run by that exact owner (the fast path).

        Fenced on the owner, not the fence: the worker's parent process knows which pool
        process died but never saw the fence the child claimed with. Atomic (one transaction).
        Returns None when the entry moved on (settled, taken over) in the meantime.
        """
        with self._txn() as conn:
            cond = [
                entries.c.key == key,
                entries.c.status == _RUNNING,
                entries.c.owner == node,
                entries.c.owner_boot == boot,
            ]
            if pid is not None:
                cond.append(entries.c.owner_pid == pid)
            found = self._interrupt(conn, select(entries.c.key).where(*cond), actor, why, dead=True)
        return found[0] if found else None

    def _interrupt(
        self, conn: Connection, keys: Select[Any], actor: str, why: str, *, dead: bool = False
    ) -> list[Interrupted]:
        # Pick the keys exactly once. PostgreSQL may plan `key IN (SELECT ... LIMIT n FOR
        # UPDATE SKIP LOCKED)` as a nested loop that rescans the subquery per outer row; each
        # rescan skips the rows this very statement already updated and picks the next n,
        # so the limit bounded nothing (measured: limit=2 interrupted all 5 expired entries).
        # A MATERIALIZED CTE is evaluated once.
        #
        # The UPDATE is a compare-and-set on the fence the pick read. The boot sweep and the
        # fast path pick by owner without a row lock: if another worker's takeover commits
        # between the pick and the UPDATE, PostgreSQL's UPDATE waits for it and then re-checks
        # its WHERE on the new row version; with the fence in the WHERE, that re-check sees
        # the new owner's fence and leaves its live attempt alone (design.md § "Recovery").
        picked = (
            keys.add_columns(entries.c.fence.label("picked_fence"))
            .cte("picked")
            .prefix_with("MATERIALIZED", dialect="postgresql")
        )
        upd = (
            update(entries)
            .where(
                entries.c.key == picked.c.key,
                entries.c.fence == picked.c.picked_fence,
                entries.c.status == _RUNNING,
            )
            .values(
                status=_INTERRUPTED,
                fence=entries.c.fence + 1,
                # Only an attempt that started the body can be lost; the lapse of a publish
                # intent or of the resume marker (both owned by RESUME_OWNER, nothing ran)
                # is a queue that was slow, not a crash (design.md § "Recovery").
                interruptions=entries.c.interruptions
                + case((entries.c.owner == RESUME_OWNER, 0), else_=1),
                lease_until=None,
                slot_at=None,  # handed on by the sweep's next handover (``ledger.slots``)
                updated_at=db_now(),
                reason=why,
                **(_death_signal(actor, why) if dead else {}),
            )
            .returning(
                *sql.RETURNED,
                entries.c.task_name,
                entries.c.interruptions,
                entries.c.snapshot.is_not(None).label("has_snapshot"),
                entries.c.executions,
                entries.c.created_at,
            )
        )
        stmt = sql.with_event(self.dialect, upd)
        rows = self._write_with_event(conn, stmt, {}, Note("interrupted", actor, why))
        return [Interrupted.from_row(r) for r in rows]

    def list_interrupted(self, *, limit: int = 500, resumable: bool = False) -> list[Interrupted]:
        """Interrupted entries, oldest first (read-only).

        ``resumable``: only those with an argument snapshot, the ones a sweep can re-send.
        The sweep lists these, so that entries it can never resume (it reports them) do not
        fill every batch and hide newer work behind them (design.md § "Recovery").
        """
        query = (
            select(
                entries.c.key,
                entries.c.task_name,
                entries.c.task_id,
                entries.c.fence,
                entries.c.interruptions,
                entries.c.snapshot.is_not(None).label("has_snapshot"),
                entries.c.executions,
                entries.c.created_at,
            )
            .where(entries.c.status == _INTERRUPTED)
            .order_by(entries.c.updated_at)
            .limit(limit)
        )
        if resumable:
            query = query.where(entries.c.snapshot.is_not(None))
        with self._read() as conn:
            rows = conn.execute(query).all()
        return [Interrupted.from_row(r) for r in rows]

    def count_unresumable(self, *, limit: int = 500) -> int:
        """How many interrupted entries have no argument snapshot, counting up to ``limit``
        (read-only): what a sweep reports and leaves for an operator or the broker."""
        bare = (
            select(entries.c.key)
            .where(entries.c.status == _INTERRUPTED, entries.c.snapshot.is_(None))
            .limit(limit)
            .subquery()
        )
        with self._read() as conn:
            return int(conn.execute(select(func.count()).select_from(bare)).scalar_one())

    def begin_resume(
        self, key: str, fence: int, *, lease_seconds: float, actor: str = "sweep"
    ) -> Resuming | None:
        """CAS ``interrupted -> running`` owned by the resume marker, in one statement that
        also returns what the winner re-sends (snapshot, completed replay rows).

        Exactly one of any number of concurrent resumers gets a ``Resuming``; the others get
        None. The winner re-enqueues the task; the claim of that delivery takes over at once
        (owner is ``RESUME_OWNER``). If the message is lost, the lease recovery holds here
        expires and the next sweep interrupts the entry again.
        """
        completed = (
            select(func.count())
            .where(steps.c.key == key, steps.c.status == StepStatus.COMPLETED.value)
            .scalar_subquery()
            .label("completed_steps")
        )
        upd = (
            update(entries)
            .where(entries.c.key == key, entries.c.fence == fence, entries.c.status == _INTERRUPTED)
            .values(
                status=_RUNNING,
                fence=fence + 1,
                owner=RESUME_OWNER,
                owner_boot=None,
                owner_pid=None,
                lease_until=db_now() + lease_seconds,
                updated_at=db_now(),
            )
            .returning(
                *sql.RETURNED,
                entries.c.task_name,
                entries.c.snapshot,
                completed,
                entries.c.deadline_at,
            )
        )
        with self._one_statement() as conn:
            stmt = sql.with_event(self.dialect, upd)
            rows = self._write_with_event(conn, stmt, {}, Note("resuming", actor))
        if not rows:
            return None
        row = rows[0]
        return Resuming.from_row(row)

    def snapshots_at(self, keys: Sequence[str]) -> dict[str, tuple[int, EntryStatus, str | None]]:
        """The fence, status and stored argument snapshot of each of ``keys`` that exists, in
        one read (a batched sweep decodes them before it begins any resume)."""
        if not keys:
            return {}
        query = select(entries.c.key, entries.c.fence, entries.c.status, entries.c.snapshot).where(
            entries.c.key.in_(list(keys))
            if self.is_sqlite
            # One array parameter, not a thousand: the statement stays small to build and plan.
            else entries.c.key == any_(bindparam("keys", list(keys), type_=ARRAY(String)))
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        return {r.key: (r.fence, EntryStatus(r.status), r.snapshot) for r in rows}

    def begin_resume_many(
        self,
        picks: Sequence[tuple[str, int]],
        *,
        lease_seconds: float,
        actor: str = "sweep",
        event: str = "resuming",
        detail: str | None = None,
    ) -> dict[str, Resuming]:
        """``begin_resume`` for many entries in one statement and one commit.

        ``event``/``detail``: the audit event written for each (``deferred`` when the caller
        takes the resume lease without sending: its message is likely still queued).

        Each row is still its own compare-and-set on (key, fence, interrupted): a row another
        resumer moved first, or holds locked right now (SKIP LOCKED on PostgreSQL, so two
        batched sweepers never deadlock on each other's rows), is left out, and the caller
        treats it as a lost race. Returns the won entries by key, each with what it re-sends.
        """
        if not picks:
            return {}
        picked = (
            select(entries.c.key, entries.c.fence.label("picked_fence"))
            .where(self._at_fences(picks), entries.c.status == _INTERRUPTED)
            .order_by(entries.c.key)
            .with_for_update(skip_locked=True)
            .cte("picked")
            .prefix_with("MATERIALIZED", dialect="postgresql")
        )
        # SQLite renders a RETURNING clause without table names, subqueries included: a
        # correlated ``steps.key = entries.key`` became ``"key" = "key"`` there and counted
        # every entry's completed rows. The entry's key is named with its table, by hand.
        entry_key = literal_column(f'{entries.name}."key"', String)
        completed = (
            select(func.count())
            .where(steps.c.key == entry_key, steps.c.status == StepStatus.COMPLETED.value)
            .scalar_subquery()
            .label("completed_steps")
        )
        # The pick holds each row locked to the commit (SQLite: BEGIN IMMEDIATE excludes every
        # other writer), so the status and fence it checked cannot change before the UPDATE;
        # the UPDATE joins on the key alone. (With the status in its WHERE, PostgreSQL drove
        # the join from the attention index and rescanned the CTE per row: 1,000 rows took
        # 0.4 s; joined on the primary key it is a few ms.)
        upd = (
            update(entries)
            .where(entries.c.key == picked.c.key, entries.c.fence == picked.c.picked_fence)
            .values(
                status=_RUNNING,
                fence=entries.c.fence + 1,
                owner=RESUME_OWNER,
                owner_boot=None,
                owner_pid=None,
                lease_until=db_now() + lease_seconds,
                updated_at=db_now(),
            )
            .returning(
                *sql.RETURNED,
                entries.c.task_name,
                entries.c.snapshot,
                completed,
                entries.c.deadline_at,
            )
        )
        with self._txn() as conn:
            stmt = sql.with_event(self.dialect, upd)
            rows = self._write_with_event(conn, stmt, {}, Note(event, actor, detail))
        return {row.key: Resuming.from_row(row) for row in rows}

    def _at_fences(self, picks: Sequence[tuple[str, int]]) -> Any:
        """The predicate ``(key, fence) IN picks``, as one parameter per column on PostgreSQL."""
        if self.is_sqlite:
            return tuple_(entries.c.key, entries.c.fence).in_(list(picks))
        # Two array parameters, not two thousand scalars (unnest pairs them up).
        pairs = (
            func.unnest(
                bindparam("w_keys", [k for k, _ in picks], type_=ARRAY(String)),
                bindparam("w_fences", [f for _, f in picks], type_=ARRAY(Integer)),
            )
            .table_valued("key", "fence")
            .render_derived()
        )
        return tuple_(entries.c.key, entries.c.fence).in_(select(pairs.c.key, pairs.c.fence))

    def list_overdue_retries(self, *, limit: int = 500) -> list[Overdue]:
        """``retrying`` entries whose due time passed on the database clock, with an argument
        snapshot to re-send from, most overdue first (read-only; the due-time index).

        The worker settles ``retrying`` with the retry's ETA plus ``ledger_retry_grace_seconds``
        as the due time: an entry still ``retrying`` then was never claimed by its retry, whose
        message may be lost.
        """
        with self._read() as conn:
            rows = conn.execute(
                select(
                    entries.c.key,
                    entries.c.task_name,
                    entries.c.task_id,
                    entries.c.fence,
                    entries.c.due_at,
                )
                .where(
                    entries.c.status == _RETRYING,
                    entries.c.due_at < db_now_stable(),
                    entries.c.snapshot.is_not(None),
                )
                .order_by(entries.c.due_at)
                .limit(limit)
            ).all()
        return [Overdue(r.key, r.task_name, r.task_id, r.fence, r.due_at) for r in rows]

    def begin_resend(
        self, key: str, fence: int, *, resend_after: float, actor: str = "sweep"
    ) -> Resuming | None:
        """CAS an overdue ``retrying`` entry at ``fence`` to fence+1, due again ``resend_after``
        seconds from now, in one statement that also returns what the winner re-sends.

        The entry stays ``retrying``: the claim of the re-sent message RUNs it like the retry
        it stands for (completed steps replay; nothing is ambiguous). Exactly one of any number
        of concurrent resenders gets a ``Resuming``; the others get None. If the re-sent
        message is lost too, the entry is overdue again after ``resend_after``.
        """
        completed = (
            select(func.count())
            .where(steps.c.key == key, steps.c.status == StepStatus.COMPLETED.value)
            .scalar_subquery()
            .label("completed_steps")
        )
        upd = (
            update(entries)
            .where(entries.c.key == key, entries.c.fence == fence, entries.c.status == _RETRYING)
            .values(fence=fence + 1, due_at=db_now() + resend_after, updated_at=db_now())
            .returning(
                *sql.RETURNED,
                entries.c.task_name,
                entries.c.snapshot,
                completed,
                entries.c.deadline_at,
            )
        )
        with self._one_statement() as conn:
            stmt = sql.with_event(self.dialect, upd)
            note = Note("resent", actor, "retry overdue: re-sent with its task id")
            rows = self._write_with_event(conn, stmt, {}, note)
        if not rows:
            return None
        row = rows[0]
        return Resuming.from_row(row)

    def block(
        self,
        key: str,
        fence: int,
        reason: str,
        *,
        actor: str,
        from_status: EntryStatus = EntryStatus.INTERRUPTED,
    ) -> bool:
        """Park an entry for an operator, fenced on (fence, ``from_status``), in one statement
        with its audit event (atomic).

        Returns False when the entry moved first (another sweeper, a claim); nothing is
        written then.
        """
        upd = (
            update(entries)
            .where(
                entries.c.key == key,
                entries.c.fence == fence,
                entries.c.status == from_status.value,
            )
            .values(
                status=EntryStatus.BLOCKED.value,
                fence=fence + 1,
                reason=reason,
                lease_until=None,
                due_at=None,
                updated_at=db_now(),
            )
            .returning(*sql.RETURNED)
        )
        with self._one_statement() as conn:
            stmt = sql.with_event(self.dialect, upd)
            return bool(self._write_with_event(conn, stmt, {}, Note("blocked", actor, reason)))

    def block_crash_loop(
        self, entry: Interrupted, *, max_resumes: int, actor: str
    ) -> CrashLoop | None:
        """Block ``entry`` if the crash-loop rule (``crash_loop_reason``) says it is one.

        Fenced like ``block`` on (``entry.fence``, interrupted), one statement. Returns None
        when it is no crash loop (nothing written), else the ``CrashLoop`` with the reason;
        its ``blocked`` is False when the entry moved first (a lost race: nothing written).
        """
        reason = crash_loop_reason(entry.interruptions, max_resumes)
        if reason is None:
            return None
        return CrashLoop(reason, self.block(entry.key, entry.fence, reason, actor=actor))

    def prune_settled(
        self, older_than_seconds: float, *, limit: int = 1000, tombstone: str | None = None
    ) -> int:
        """Delete up to ``limit`` settled entries older than the window, with steps, events and
        signals.

        ``tombstone`` (design.md § "Durable time"; the encoded failure a late delivery of a pruned
        failed,
        cancelled or expired key raises): keep each entry's row as a tombstone instead, with
        its key, arguments hash, final status and settled time (``tombstone_at``) and nothing
        else (``ScheduleQueries.prune_tombstones`` deletes it after its own window).

        Atomic (one transaction). Rows another transaction holds (a release in progress) are
        skipped, not waited for. Returns how many entries this call deleted.

        A redelivery of a pruned key finds no entry and runs again: the retention window
        must exceed the longest time a duplicate can still arrive.
        """
        # Lock what we delete. A release un-settles a failed entry so it can run again;
        # without the lock we could delete its replay rows and events between our read and
        # its commit, and the resumed body would re-run steps that completed. (On SQLite the
        # lock clause renders as nothing: BEGIN IMMEDIATE already excludes every other writer.)
        picked = (
            select(entries.c.key)
            .where(
                entries.c.settled_at.is_not(None),
                entries.c.settled_at < db_now_stable() - older_than_seconds,
            )
            .order_by(entries.c.settled_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        with self._txn() as conn:
            keys = [k for (k,) in conn.execute(picked)]
            if not keys:
                return 0
            conn.execute(delete(steps).where(steps.c.key.in_(keys)))
            conn.execute(delete(events).where(events.c.key.in_(keys)))
            # A settled entry has no wait left to take a signal (design.md § "Durable signals").
            conn.execute(delete(signals).where(signals.c.key.in_(keys)))
            # Settled while held for a token (cancelled, expired): that hold is over.
            conn.execute(delete(rate_holds).where(rate_holds.c.key.in_(keys)))
            picked_rows = entries.c.key.in_(keys) & entries.c.settled_at.is_not(None)
            if tombstone is None:
                conn.execute(delete(entries).where(picked_rows))
            else:
                conn.execute(
                    update(entries).where(picked_rows).values(**tombstone_values(tombstone))
                )
            return len(keys)

    def count_expired(self) -> int:
        """How many running entries have an expired lease right now (index-only)."""
        with self._read() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(entries)
                    .where(entries.c.status == _RUNNING, entries.c.lease_until < db_now_stable())
                ).scalar_one()
            )


def _death_signal(actor: str, why: str) -> dict[str, Any]:
    """The stamp of an interrupt that proves the attempt dead: the worker's parent saw its
    pool process exit (the fast path), or a worker's previous boot is gone (the boot sweep).
    It is ``mark-dead``'s stamp (every attempt up to the interrupted fence is dead), made by
    the process that knows: the death-signal gate and a reconciler's ``not_executed``
    verdict need no wait for such an attempt. (The old fence: SET reads the row as it was.)"""
    return {
        "dead_fence": entries.c.fence,
        "dead_by": actor[:255],
        "dead_reason": why[:2000],
        "dead_at": db_now(),
    }
