"""Operator queries: read entries, steps and events; release a stuck entry; aggregate stats.

Reads run in a read-only transaction (deferred on SQLite, so they never block a writer);
``release`` is the one write, one transaction under the entry's row lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, or_, select, update

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.core import Note, StoreCore
from celery_ledger.ledger.dbclock import db_now, db_now_stable
from celery_ledger.ledger.death import death_gate
from celery_ledger.ledger.errors import (
    EntryNotFound,
    ReferenceTooLong,
    ReleaseRefused,
)
from celery_ledger.ledger.operator_text import check_release_text
from celery_ledger.ledger.schema import entries, events, steps
from celery_ledger.ledger.states import EntryStatus, SideEffect, StepStatus, Verdict
from celery_ledger.ledger.values import (
    RELEASABLE,
    RESUME_OWNER,
    TOMBSTONE_NOT_RELEASABLE,
    Entry,
    EventRecord,
)

#: Name of the implicit step that stands for the whole body of a task that recorded no steps.
BODY_STEP = "__body__"

#: Longest key, key prefix or task id an entry can be found by: a task id's column width (a
#: key is 64). A longer one matches nothing, and is refused as bad input before SQLite reads it
#: (its LIKE refuses a pattern over 50,000 bytes, an error that reads as an outage).
MAX_REFERENCE_CHARS = 255


@dataclass(frozen=True)
class Release:
    """What a release did."""

    key: str
    verified: Verdict
    from_status: EntryStatus
    to_status: EntryStatus
    fence: int
    steps_released: tuple[str, ...]
    task_name: str
    task_id: str
    snapshot: str | None


@dataclass(frozen=True)
class LedgerStats:
    """Aggregates for ``stats`` and the metrics collector."""

    by_status: dict[str, int]
    by_task_status: dict[tuple[str, str], int]
    expired_running: int
    oldest_running_age: float
    interruptions: int
    #: All entries (keys) in the ledger.
    entries: int
    duplicate_executions: int
    #: Published tasks no worker has claimed yet (running under the resume marker with no
    #: execution: a publish intent, or a re-send still in a queue): the backlog.
    unclaimed: int = 0
    #: Seconds since the oldest of them was published (database clock).
    oldest_unclaimed_age: float = 0.0
    #: How often their leases lapsed while they waited: each lapse was a re-send, or a
    #: re-send the sweep deferred because the queue held messages (``recovery.backlog``).
    #: Growing while ``unclaimed`` stays: a backlog, not lost messages.
    unclaimed_lapses: int = 0

    @property
    def duplicate_execution_rate(self) -> float:
        """Step executions beyond 1 + authorized verdicts, per ledger entry (target 0.0); a
        second input run at one step name and position counts as one."""
        return self.duplicate_executions / self.entries if self.entries else 0.0


class OperatorQueries(StoreCore):
    """What the CLI, the metrics collector and the Flower glue read and write.

    Every method but ``release`` only reads, in one read-only transaction.
    """

    def get_entry(self, key: str) -> Entry:
        """The entry for ``key``.

        Raises:
            EntryNotFound: when there is none.
        """
        with self._read() as conn:
            row = conn.execute(select(entries).where(entries.c.key == key)).one_or_none()
        if row is None:
            raise EntryNotFound(f"no ledger entry with key {key}")
        return Entry.from_row(row)

    def find_keys(self, prefix_or_task_id: str, *, limit: int = 5) -> list[str]:
        """Keys that start with ``prefix_or_task_id`` or whose task id equals it.

        Raises:
            ReferenceTooLong: it is longer than ``MAX_REFERENCE_CHARS``; nothing is read.
        """
        if len(prefix_or_task_id) > MAX_REFERENCE_CHARS:
            raise ReferenceTooLong(
                f"a key, key prefix or task id is at most {MAX_REFERENCE_CHARS} characters; "
                f"this one is {len(prefix_or_task_id)} long, so nothing matches it"
            )
        with self._read() as conn:
            return [
                k
                for (k,) in conn.execute(
                    select(entries.c.key)
                    .where(
                        or_(
                            entries.c.key.startswith(prefix_or_task_id, autoescape=True),
                            entries.c.task_id == prefix_or_task_id,
                        )
                    )
                    .limit(limit)
                )
            ]

    def list_entries(
        self,
        *,
        statuses: list[str] | None = None,
        task: str | None = None,
        stuck: bool = False,
        since_seconds: float | None = None,
        limit: int = 50,
    ) -> list[Entry]:
        """Entries, newest first. ``stuck``: interrupted, blocked, running past the lease, or
        retrying past the due time (the retry never arrived; the sweep re-sends it), or
        scheduled/sleeping past the due time (the sweep has not sent it: is beat running?)."""
        q = select(entries).order_by(entries.c.updated_at.desc()).limit(limit)
        if statuses:
            q = q.where(entries.c.status.in_(statuses))
        if task:
            q = q.where(entries.c.task_name == task)
        if stuck:
            q = q.where(
                or_(
                    entries.c.status.in_(
                        [EntryStatus.INTERRUPTED.value, EntryStatus.BLOCKED.value]
                    ),
                    (entries.c.status == EntryStatus.RUNNING.value)
                    & (entries.c.lease_until < db_now_stable()),
                    (entries.c.status == EntryStatus.RETRYING.value)
                    & (entries.c.due_at < db_now_stable()),
                    # design.md § "Durable time": held past its due time (no beat is sweeping?)
                    entries.c.status.in_([EntryStatus.SCHEDULED.value, EntryStatus.SLEEPING.value])
                    & (entries.c.due_at < db_now_stable()),
                )
            )
        if since_seconds is not None:
            q = q.where(entries.c.updated_at >= db_now_stable() - since_seconds)
        with self._read() as conn:
            return [Entry.from_row(r) for r in conn.execute(q)]

    def entry_events(self, key: str, *, limit: int = 200) -> list[EventRecord]:
        """The audit trail of ``key``, oldest first (read-only)."""
        with self._read() as conn:
            rows = conn.execute(
                select(events).where(events.c.key == key).order_by(events.c.id).limit(limit)
            ).all()
        return [EventRecord(**r._mapping) for r in rows]

    def first_execution_at(self, key: str) -> float:
        """When an attempt first ran ``key``'s body, on the database clock (read-only).

        That is its first ``claimed`` event: the claim that inserted the entry with one
        execution, or the first claim of a publish intent (``record_intent``, which wrote
        ``queued``). The entry's ``created_at`` stands in when no such event is left: it is
        never later (a publish intent is created before it first runs).

        Raises:
            EntryNotFound: when there is no entry.
        """
        first_claim = (
            select(func.min(events.c.at))
            .where(events.c.key == key, events.c.event == "claimed")
            .scalar_subquery()
        )
        with self._read() as conn:
            at = conn.execute(
                select(func.coalesce(first_claim, entries.c.created_at)).where(entries.c.key == key)
            ).scalar_one_or_none()
        if at is None:
            raise EntryNotFound(f"no ledger entry with key {key}")
        return float(at)

    def now(self) -> float:
        """The database clock, seconds since the epoch."""
        with self._read() as conn:
            return float(conn.execute(select(db_now())).scalar_one())

    def release(
        self,
        key: str,
        verified: Verdict,
        *,
        by: str,
        reason: str,
        result: str | None = None,
        require_death_signal: bool = False,
    ) -> Release:
        """Apply an operator's verdict to a stuck entry, once, in one transaction.

        ``completed``: the entry becomes completed with ``result``; every later delivery returns
        it. ``not_executed``: its ambiguous steps (or its body, when it recorded no steps)
        become ``not_executed``, authorizing exactly one more run, and the entry becomes
        ``interrupted`` so that recovery (or ``resume``) runs it. The fence is bumped either
        way, so an attempt still alive somewhere can write nothing more. With
        ``require_death_signal`` (``ledger_release_requires_death_signal``), a
        ``not_executed`` release of an ambiguous step waits for ``mark_dead`` (``death_gate``).

        Atomic (one transaction) and fenced by the entry's row lock: two releases racing
        serialize on it, and the second is refused as one-shot.

        Raises:
            EntryNotFound: no such key.
            ReleaseRefused: completed entry, live lease, released already and not run since,
                a tombstone (``TOMBSTONE_NOT_RELEASABLE``), or the verdict is not
                completed/not_executed.
            DeathSignalRequired: ``require_death_signal`` and no ``mark_dead`` covers the
                attempt that started the ambiguous step.
            OperatorTextError: ``by`` or ``reason`` is blank, too long or not printable
                (``check_release_text``); nothing is read or written.
        """
        if verified is Verdict.UNKNOWN:
            raise ReleaseRefused("release needs --verified completed or not-executed")
        check_release_text(by, reason)
        with self._txn() as conn:
            row = conn.execute(
                select(entries, (entries.c.lease_until - db_now()).label("remaining"))
                .where(entries.c.key == key)
                .with_for_update()
            ).one_or_none()
            if row is None:
                raise EntryNotFound(f"no ledger entry with key {key}")
            _refuse_release(key, row)
            if require_death_signal and verified is Verdict.NOT_EXECUTED:
                death_gate(conn, row)
            return self._apply_release(
                conn, key, row, verified, by=by, reason=reason, result=result
            )

    def _apply_release(
        self,
        conn: Any,
        key: str,
        row: Any,
        verified: Verdict,
        *,
        by: str,
        reason: str,
        result: str | None,
    ) -> Release:
        """Write a release that ``_refuse_release`` let through, under the entry's row lock
        (the caller's transaction): the steps, then the entry at fence + 1 with its event."""
        found = EntryStatus(row.status)
        fence = row.fence + 1
        now = db_now()
        released: tuple[str, ...] = ()
        if verified is Verdict.COMPLETED:
            to_status = EntryStatus.COMPLETED
            conn.execute(
                update(steps)
                .where(
                    steps.c.key == key,
                    steps.c.status == StepStatus.STARTED.value,
                )
                .values(status=StepStatus.COMPLETED.value, completed_at=now, fence=fence)
            )
        else:
            to_status = EntryStatus.INTERRUPTED
            released = self._release_ambiguous_steps(conn, key, fence)
        upd = (
            update(entries)
            .where(entries.c.key == key)
            .values(
                status=to_status.value,
                fence=fence,
                lease_until=None,
                updated_at=now,
                result=result if to_status is EntryStatus.COMPLETED else row.result,
                error=None,
                reason=None,
                settled_at=now if to_status is EntryStatus.COMPLETED else None,
                interruptions=0,
                released_by=by,
                released_reason=reason,
                released_at=now,
                released_from=found.value,
                released_executions=row.executions,
                due_at=None,
            )
            .returning(*sql.RETURNED)
        )
        detail = f"verified {verified.value} from {found.value}: {reason}" + (
            f" (steps: {', '.join(released)})" if released else ""
        )
        note = Note("released", by, detail)
        self._write_with_event(conn, sql.with_event(self.dialect, upd), {}, note)
        return Release(
            key,
            verified,
            found,
            to_status,
            fence,
            released,
            row.task_name,
            row.task_id,
            row.snapshot,
        )

    def _release_ambiguous_steps(self, conn: Any, key: str, fence: int) -> tuple[str, ...]:
        ambiguous = (
            conn.execute(
                select(steps.c.name).where(
                    steps.c.key == key, steps.c.status == StepStatus.STARTED.value
                )
            )
            .scalars()
            .all()
        )
        if ambiguous:
            conn.execute(
                update(steps)
                .where(
                    steps.c.key == key,
                    steps.c.status == StepStatus.STARTED.value,
                )
                .values(
                    status=StepStatus.NOT_EXECUTED.value,
                    fence=fence,
                    authorized=steps.c.authorized + 1,
                )
            )
            return tuple(ambiguous)
        has_rows = conn.execute(
            select(func.count()).select_from(steps).where(steps.c.key == key)
        ).scalar_one()
        if has_rows:
            return ()
        # No replay rows at all: the body itself was the ambiguous effect.
        conn.execute(
            steps.insert().values(
                key=key,
                name=BODY_STEP,
                input_hash="",
                occurrence=0,
                seq=0,
                status=StepStatus.NOT_EXECUTED.value,
                fence=fence,
                attempts=1,
                authorized=1,
                started_at=db_now(),
            )
        )
        return (BODY_STEP,)

    def rewrite_snapshots(
        self,
        transform: Callable[[str], str | None],
        *,
        after: str = "",
        limit: int = 500,
    ) -> tuple[int, str | None]:
        """One batch of ``reseal``: the snapshots of up to ``limit`` entries with a key above
        ``after`` (key order), each replaced by ``transform(old)`` (None: left as it is).

        One transaction; each row is a compare-and-set on its old snapshot, so a snapshot a
        claim rewrote meanwhile is left alone (the claim wrote it with the current key).
        Returns (rows rewritten, the last key read; None when there are no more).
        """
        with self._txn() as conn:
            rows = conn.execute(
                select(entries.c.key, entries.c.snapshot)
                .where(entries.c.key > after, entries.c.snapshot.is_not(None))
                .order_by(entries.c.key)
                .limit(limit)
            ).all()
            done = 0
            for key, old in rows:
                new = transform(old)
                if new is None or new == old:
                    continue
                done += conn.execute(
                    update(entries)
                    .where(entries.c.key == key, entries.c.snapshot == old)
                    .values(snapshot=new)
                ).rowcount
        return done, (rows[-1][0] if len(rows) == limit else None)

    def stats(self) -> LedgerStats:
        """Aggregates over the ledger, each from an indexed query."""
        with self._read() as conn:
            by_task_status = {
                (t, s): int(n)
                for t, s, n in conn.execute(
                    select(entries.c.task_name, entries.c.status, func.count()).group_by(
                        entries.c.task_name, entries.c.status
                    )
                )
            }
            # One pass over the running entries' index; an unclaimed one (no execution, under
            # the resume marker) moved its fence twice per lapse: interrupt, resume or defer.
            unclaimed = (entries.c.owner == RESUME_OWNER) & (entries.c.executions == 0)
            running = conn.execute(
                select(
                    func.count(case((entries.c.lease_until < db_now_stable(), 1))),
                    func.coalesce(func.max(db_now() - entries.c.updated_at), 0.0),
                    func.count(case((unclaimed, 1))),
                    func.coalesce(
                        func.max(case((unclaimed, db_now() - entries.c.created_at))), 0.0
                    ),
                    func.coalesce(func.sum(case((unclaimed, entries.c.fence - 1))), 0),
                ).where(entries.c.status == EntryStatus.RUNNING.value)
            ).one()
            interruptions = conn.execute(
                select(func.coalesce(func.sum(entries.c.interruptions), 0)).where(
                    entries.c.status.in_(
                        [
                            EntryStatus.INTERRUPTED.value,
                            EntryStatus.BLOCKED.value,
                            EntryStatus.RUNNING.value,
                        ]
                    )
                )
            ).scalar_one()
            # Only rows with an unauthorized extra attempt, through their partial index: the
            # cost follows the duplicates (zero, normally), not the size of the steps table.
            # A re-run of one row and a second input run at one step name and position (the
            # step write counts both in ``attempts``) are alike here. read/idempotent/keyed
            # steps may legitimately run again (keyed ones with the same provider key, which
            # the provider deduplicates): only the other classes count.
            #
            # ``attempts > 1`` is implied by the index predicate and changes no result; it is
            # there for PostgreSQL's planner, which cannot estimate ``attempts > authorized +
            # 1`` (a fixed third of the table) but can estimate ``attempts > 1`` from the
            # column's statistics (almost never). Without it, measured at 200,000 entries,
            # the planner hashed the whole entries table (a sequential scan, 125 ms); with it,
            # a nested loop over the partial index and the entries' primary key.
            duplicates = conn.execute(
                select(func.coalesce(func.sum(steps.c.attempts - 1 - steps.c.authorized), 0))
                .select_from(steps.join(entries, entries.c.key == steps.c.key))
                .where(
                    steps.c.attempts > 1,
                    steps.c.attempts > steps.c.authorized + 1,
                    entries.c.side_effect.in_(
                        [SideEffect.NON_IDEMPOTENT.value, SideEffect.IRREVERSIBLE.value]
                    ),
                )
            ).scalar_one()
        by_status: dict[str, int] = {s.value: 0 for s in EntryStatus}
        for (_, s), n in by_task_status.items():
            by_status[s] = by_status.get(s, 0) + n
        return LedgerStats(
            by_status,
            by_task_status,
            int(running[0]),
            float(running[1]),
            int(interruptions),
            sum(by_status.values()),
            int(duplicates),
            unclaimed=int(running[2]),
            oldest_unclaimed_age=float(running[3]),
            unclaimed_lapses=int(running[4]) // 2,
        )


def _refuse_release(key: str, row: Any) -> None:
    """Refuse a release of the entry ``row`` (read under its row lock) that must not happen.

    Raises:
        ReleaseRefused: a tombstone, a completed entry, a live lease, or released already and
            not run since (one-shot).
    """
    found = EntryStatus(row.status)
    if row.tombstone_at is not None:
        raise ReleaseRefused(f"{key} is {TOMBSTONE_NOT_RELEASABLE}")
    if found is EntryStatus.COMPLETED:
        raise ReleaseRefused(f"{key} is completed; there is nothing to release")
    if found is EntryStatus.RUNNING and row.remaining is not None and row.remaining > 0:
        raise ReleaseRefused(
            f"{key} is running with a live lease ({row.remaining:.0f}s left, owner "
            f"{row.owner}); wait for it to expire or for the sweep to interrupt it"
        )
    if found not in RELEASABLE:  # pragma: no cover - every other status is listed
        raise ReleaseRefused(f"{key} is {found.value}")
    if row.released_executions is not None and row.executions == row.released_executions:
        # One-shot: no attempt has run the body since the release (executions counts
        # the attempts that did; the fence also moves for a resume whose message never
        # ran, or a sweep). A second verdict (two operators, a retried command) must
        # not authorize a second re-run or overwrite the first operator's stamp.
        raise ReleaseRefused(
            f"{key} was released already by {row.released_by} "
            f"({row.released_reason!r}) and has not run since; release is one-shot"
        )
