"""The recovery sweep: find interrupted work and hand it back to Celery.

Why re-enqueue rather than run the body here (the argument DBOS's ``_recovery.py`` makes): the
sweeper may be beat, a worker booting, or an operator's CLI. None of them is the right process
to execute user code: wrong queue, wrong concurrency limits, wrong time limits, and a crash of
the sweeper would then lose the sweep *and* the work. Re-enqueueing with the original task id
and argument snapshot puts the work back where Celery's own guarantees apply; the claim of that
delivery takes over with a new fence and replays completed steps.

Why one resumer only: ``begin_resume`` is a compare-and-set on (key, fence, interrupted), so two
beats, or a beat and a CLI, racing for the same entry enqueue it once. If the enqueued message
is lost, the lease the resumer holds expires and the next sweep interrupts the entry again.

Why the crash-loop rule is not here: whether an entry has been interrupted too often is the
ledger's decision (``celery_ledger.ledger.crash_loop_reason``), made the same way by the claim
of its next delivery and by ``store.block_crash_loop`` here.

Why an entry without a snapshot is passed over, not parked: the sweep cannot re-send it, but
the broker may still deliver it (Redis and RabbitMQ give back a killed worker's message), and
that delivery must find it ``interrupted`` and take it over, not ``blocked``; an operator sees
it in ``list --stuck`` meanwhile. The sweep lists only entries it can resume, so any number of
them never hides newer work.

Why an unreadable snapshot is parked: nothing can ever re-send it (no process decodes it, the
broker's copy included), so it is ``blocked`` with the reason, before any resume is begun.

Why errors are contained per entry: one entry the sweep cannot handle must not cost every other
entry of the batch its resume, nor the retention its prune. An unavailable ledger is no entry's
fault; it ends the sweep (the next one retries).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from celery_ledger.ledger import (
    ArgumentSnapshot,
    EntryNotFound,
    EntryStatus,
    Interrupted,
    LedgerStore,
    LedgerUnavailable,
    Overdue,
    Resuming,
    SnapshotCipher,
    SnapshotSealError,
)
from celery_ledger.recovery import wake
from celery_ledger.recovery.backlog import QueueDepths, backoff_lease
from celery_ledger.recovery.handoff import (
    ResumeOutcome,
    UnreadableSnapshot,
    expire_passed,
    park_unreadable,
    read_snapshot,
)
from celery_ledger.recovery.outbox import sweep_outbox
from celery_ledger.recovery.publish import Batch
from celery_ledger.recovery.resend import send, send_on

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepReport:
    """What one sweep did."""

    #: Running entries whose lease had expired, now interrupted by this sweep.
    interrupted: int = 0
    #: Interrupted entries this sweep looked at.
    found: int = 0
    #: Re-enqueued with their original task id.
    resumed: int = 0
    #: Parked as crash loops (interrupted more than max_resumes times).
    blocked: int = 0
    #: Interrupted entries without an argument snapshot: reported, never guessed (counted up
    #: to one batch).
    no_snapshot: int = 0
    #: Settled entries deleted by retention.
    pruned: int = 0
    resumed_keys: tuple[str, ...] = field(default=())
    #: ``retrying`` entries past their due time (their retry never arrived) ...
    overdue: int = 0
    #: ... of which re-sent with their task id.
    resent: int = 0
    #: Entries the sweep could not handle (logged with the error); the rest went on.
    errors: int = 0
    #: design.md § "Durable time": scheduled/sleeping entries past their due time ...
    due: int = 0
    #: ... of which sent with their task id.
    woken: int = 0
    #: Entries with a pending cancellation settled ``cancelled`` (no live attempt had them).
    cancelled: int = 0
    #: Children recorded by steps and still unpublished past the grace (the outbox) ...
    outbox_pending: int = 0
    #: ... of which published (confirmed) and marked by this sweep.
    outbox_published: int = 0
    #: ... and of which not published for a fault of their own (an option no publish can
    #: send): noted on their rows, counted in ``errors`` too; the others went on.
    outbox_failed: int = 0
    #: Entries no worker claimed yet, not re-sent because their queue holds messages (a
    #: backlog suspected: ``recovery.backlog``).
    deferred: int = 0
    #: Entries about to be sent again whose deadline had passed: settled ``expired`` instead
    #: (the admission gate at recovery's door; a discarded expired message is never re-sent).
    expired: int = 0

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["resumed_keys"] = list(self.resumed_keys)
        return data


def _snapshot_at(
    store: LedgerStore,
    key: str,
    fence: int,
    status: EntryStatus,
    cipher: SnapshotCipher | None = None,
) -> ArgumentSnapshot | str | None:
    """The entry's decoded snapshot while it is still ``status`` at ``fence``; the reason
    it cannot be read (a str); or None when the entry moved on (a lost race)."""
    try:
        entry = store.get_entry(key)
    except EntryNotFound:
        return None
    if entry.fence != fence or entry.status is not status or entry.snapshot is None:
        return None
    try:
        return read_snapshot(entry.snapshot, cipher)
    except SnapshotSealError as exc:
        # Not the snapshot's fault but this process's (no key, or not the key that sealed
        # it): parking the entry would need an operator for what a configuration fixes. It
        # stays interrupted for a process that holds the key.
        log.error(
            "cannot resume key=%s fence=%s here: %s; a process with the key resumes it",
            key,
            fence,
            exc,
        )
        return None
    except UnreadableSnapshot as exc:
        return f"argument snapshot cannot be read: {exc}; release it once you know what it was"


def _snapshot_to_send(
    store: LedgerStore,
    entry: Interrupted | Overdue,
    status: EntryStatus,
    *,
    cipher: SnapshotCipher | None,
    actor: str,
) -> ArgumentSnapshot | ResumeOutcome:
    """The snapshot to re-send ``entry`` with, read while it is still ``status`` at its fence;
    or, instead, LOST_RACE (it moved on, or this process cannot unseal it) or what parking an
    unreadable one for an operator returned."""
    snapshot = _snapshot_at(store, entry.key, entry.fence, status, cipher)
    if snapshot is None:
        return ResumeOutcome.LOST_RACE
    if isinstance(snapshot, str):
        return park_unreadable(
            store, entry.key, entry.task_id, entry.fence, snapshot, status=status, actor=actor
        )
    return snapshot


def _screen(
    store: LedgerStore, entry: Interrupted, *, max_resumes: int, actor: str
) -> ResumeOutcome | None:
    """What becomes of ``entry`` before any resume: BLOCKED (a crash loop, the ledger's
    rule), LOST_RACE, NO_SNAPSHOT; or None when it is to be resumed."""
    crash_loop = store.block_crash_loop(entry, max_resumes=max_resumes, actor=actor)
    if crash_loop is not None:
        if not crash_loop.blocked:
            return ResumeOutcome.LOST_RACE
        log.warning(
            "blocked key=%s task_id=%s fence=%s: %s",
            entry.key,
            entry.task_id,
            entry.fence + 1,
            crash_loop.reason,
        )
        return ResumeOutcome.BLOCKED
    if not entry.has_snapshot:
        log.warning(
            "interrupted key=%s task_id=%s fence=%s has no argument snapshot; resume "
            "it by hand or release it: celery-ledger show %s",
            entry.key,
            entry.task_id,
            entry.fence,
            entry.key,
        )
        return ResumeOutcome.NO_SNAPSHOT
    return None


def resume_entry(
    store: LedgerStore,
    app: Any,
    entry: Interrupted,
    *,
    lease_seconds: float,
    max_resumes: int,
    actor: str = "sweep",
    cipher: SnapshotCipher | None = None,
) -> ResumeOutcome:
    """Re-enqueue one interrupted entry, or block it as a crash loop (the ledger decides) or
    for a snapshot no process can read.

    Returns the ``ResumeOutcome``. A sweep resumes its entries in batches
    (``resume_batch``); this is the same, one entry at a time (the CLI, Flower).
    """
    screened = _screen(store, entry, max_resumes=max_resumes, actor=actor)
    if screened is not None:
        return screened
    # Decode before the resume begins: an entry whose snapshot no process can read is parked
    # where an operator sees it, not hidden under a resume lease that lapses again and again.
    snapshot = _snapshot_to_send(store, entry, EntryStatus.INTERRUPTED, cipher=cipher, actor=actor)
    if isinstance(snapshot, ResumeOutcome):
        return snapshot
    # The CAS re-checks the fence the snapshot was read at, so what is sent is that snapshot.
    won = store.begin_resume(entry.key, entry.fence, lease_seconds=lease_seconds, actor=actor)
    if won is None:
        return ResumeOutcome.LOST_RACE
    with Batch(app) as batch:
        return _resend_won(batch, entry, won, snapshot, lease_seconds=lease_seconds)


def resume_batch(
    store: LedgerStore,
    app: Any,
    batch: Sequence[Interrupted],
    *,
    lease_seconds: float,
    max_resumes: int,
    actor: str = "sweep",
    cipher: SnapshotCipher | None = None,
) -> list[ResumeOutcome | None]:
    """``resume_entry`` for each of ``batch``, in bulk: one read of the snapshots, one
    statement and one commit for every compare-and-set, and the re-sends over one producer.

    Each entry keeps its own outcome, as ``resume_entry`` would give it, and its own
    containment: an entry that raises is logged and gets None, and the others go on. If a
    bulk step fails for a reason other than an unavailable ledger, its entries are resumed
    one at a time instead, so one bad entry never costs the batch its resume.

    Raises:
        LedgerUnavailable: the ledger went away; the next sweep does the rest.
    """
    outcomes: dict[int, ResumeOutcome | None] = {}
    ready: list[int] = []
    for i, entry in enumerate(batch):
        try:
            screened = _screen(store, entry, max_resumes=max_resumes, actor=actor)
        except LedgerUnavailable:
            raise
        except Exception:
            log.exception("sweep could not resume key=%s; the sweep goes on", entry.key)
            outcomes[i] = None
            continue
        if screened is None:
            ready.append(i)
        else:
            outcomes[i] = screened

    def one_by_one(which: Sequence[int]) -> None:
        for i in which:
            outcomes[i] = _contained(
                batch[i].key,
                "resume",
                partial(
                    resume_entry,
                    store,
                    app,
                    batch[i],
                    lease_seconds=lease_seconds,
                    max_resumes=max_resumes,
                    actor=actor,
                    cipher=cipher,
                ),
            )

    # Decode before the resume begins (see resume_entry), all snapshots in one read.
    try:
        stored = store.snapshots_at([batch[i].key for i in ready])
    except LedgerUnavailable:
        raise
    except Exception:
        log.exception("sweep could not read %d snapshots at once; one at a time", len(ready))
        one_by_one(ready)
        return [outcomes[i] for i in range(len(batch))]
    decoded: dict[int, ArgumentSnapshot] = {}
    for i in ready:
        entry = batch[i]
        found = stored.get(entry.key)
        if (
            found is None
            or found[0] != entry.fence
            or found[1] is not EntryStatus.INTERRUPTED
            or found[2] is None
        ):
            outcomes[i] = ResumeOutcome.LOST_RACE
            continue
        try:
            decoded[i] = read_snapshot(found[2], cipher)
        except SnapshotSealError as exc:
            # This process's fault, not the snapshot's (see _snapshot_at): it stays interrupted
            # for a process that holds the key.
            log.error(
                "cannot resume key=%s fence=%s here: %s; a process with the key resumes it",
                entry.key,
                entry.fence,
                exc,
            )
            outcomes[i] = ResumeOutcome.LOST_RACE
        except UnreadableSnapshot as exc:
            reason = (
                f"argument snapshot cannot be read: {exc}; release it once you know what it was"
            )
            outcomes[i] = _contained(
                entry.key,
                "park",
                partial(
                    park_unreadable,
                    store,
                    entry.key,
                    entry.task_id,
                    entry.fence,
                    reason,
                    status=EntryStatus.INTERRUPTED,
                    actor=actor,
                ),
            )
    # Every CAS at the fence its snapshot was read at, one statement and one commit per
    # group of the same lease (entries no attempt claimed back off: ``recovery.backlog``).
    groups = _plan(store, app, batch, decoded, lease_seconds)
    won: dict[str, Resuming] = {}
    try:
        for (lease, deferred), members in groups.items():
            won.update(
                store.begin_resume_many(
                    [(batch[i].key, batch[i].fence) for i in members],
                    lease_seconds=lease,
                    actor=actor,
                    event="deferred" if deferred else "resuming",
                    detail=f"its queue holds messages; not re-sent for {lease:.0f}s"
                    if deferred
                    else None,
                )
            )
    except LedgerUnavailable:
        raise
    except Exception:
        log.exception("sweep could not begin %d resumes at once; one at a time", len(decoded))
        one_by_one([i for i in decoded if batch[i].key not in won])
        return [outcomes[i] for i in range(len(batch))]
    for (lease, deferred), members in groups.items():
        if not deferred:
            continue
        for i in members:
            outcomes[i] = ResumeOutcome.DEFERRED if batch[i].key in won else ResumeOutcome.LOST_RACE
            decoded.pop(i)
            if batch[i].key in won:
                log.info(
                    "deferred key=%s task_id=%s: no worker claimed it yet and its queue holds "
                    "messages; not re-sent for %.0fs",
                    batch[i].key,
                    batch[i].task_id,
                    lease,
                )
    sends = [(i, snapshot, won.get(batch[i].key)) for i, snapshot in decoded.items()]
    with Batch(app) as sender:
        for start in range(0, len(sends), SEND_CHUNK):
            _send_chunk(sender, batch, sends[start : start + SEND_CHUNK], outcomes, lease_seconds)
    return [outcomes[i] for i in range(len(batch))]


def _plan(
    store: LedgerStore,
    app: Any,
    batch: Sequence[Interrupted],
    decoded: dict[int, ArgumentSnapshot],
    lease_seconds: float,
) -> dict[tuple[float, bool], list[int]]:
    """The resumes to begin, grouped by (lease, deferred): an entry a worker claimed before
    is re-sent under ``lease_seconds``; one no attempt ever claimed backs off with how long it
    has waited, and is deferred (its lease taken, nothing sent) while its queue holds messages
    (``recovery.backlog``)."""
    groups: dict[tuple[float, bool], list[int]] = {}
    fresh = [i for i in decoded if batch[i].executions == 0 and batch[i].created_at is not None]
    now = store.now() if fresh else 0.0
    depths = QueueDepths(app)
    for i in decoded:
        entry = batch[i]
        if i not in fresh:
            groups.setdefault((lease_seconds, False), []).append(i)
            continue
        assert entry.created_at is not None
        lease = backoff_lease(lease_seconds, now - entry.created_at)
        waiting = depths.of(decoded[i].queue)
        groups.setdefault((lease, bool(waiting)), []).append(i)
    return groups


#: Re-sends written per broker round trip where kombu can buffer them (Redis). A flush that
#: fails costs at most this many entries their resume until their lease lapses.
SEND_CHUNK = 100


def _send_chunk(
    sender: Batch,
    batch: Sequence[Interrupted],
    sends: Sequence[tuple[int, ArgumentSnapshot, Resuming | None]],
    outcomes: dict[int, ResumeOutcome | None],
    lease_seconds: float,
) -> None:
    """Re-send one chunk of won resumes and record each one's outcome.

    A send that raises is that entry's LOST_RACE (logged; its lease brings it back). Where
    sends are buffered (Redis), none counts as sent before the flush succeeds: a failed flush
    makes every entry of the chunk a LOST_RACE (their re-sends may or may not be on the broker;
    either way the next sweep finds the entry running under the resume marker, or claimed).
    """
    queued: list[tuple[int, Resuming]] = []
    for i, snapshot, won in sends:
        if won is None:
            outcomes[i] = ResumeOutcome.LOST_RACE
            continue
        try:
            send_on(sender, won.task_name, won.task_id, snapshot, deadline_at=won.deadline_at)
        except Exception as exc:  # noqa: BLE001 - this entry alone; the lease brings it back
            _log_unsent(batch[i], won, exc, lease_seconds)
            outcomes[i] = ResumeOutcome.LOST_RACE
            continue
        if sender.deferred:
            queued.append((i, won))
        else:  # unbuffered (RabbitMQ confirms each publish): the broker has it already
            _report_resumed(batch, [(i, won)], outcomes)
    try:
        sender.flush()
    except Exception as exc:  # noqa: BLE001 - the chunk's leases bring it back
        for i, won in queued:
            _log_unsent(batch[i], won, exc, lease_seconds)
            outcomes[i] = ResumeOutcome.LOST_RACE
        return
    _report_resumed(batch, queued, outcomes)


def _report_resumed(
    batch: Sequence[Interrupted],
    queued: Sequence[tuple[int, Resuming]],
    outcomes: dict[int, ResumeOutcome | None],
) -> None:
    for i, won in queued:
        _log_resumed(batch[i], won)
        outcomes[i] = ResumeOutcome.RESUMED


def _log_unsent(
    entry: Interrupted, won: Resuming, exc: BaseException, lease_seconds: float
) -> None:
    log.error(
        "resume of key=%s task_id=%s fence=%s could not be sent (%r); the next sweep "
        "after %ss retries it",
        entry.key,
        won.task_id,
        won.fence,
        exc,
        lease_seconds,
    )


def _log_resumed(entry: Interrupted, won: Resuming) -> None:
    log.info(
        "resumed key=%s task_id=%s fence=%s task=%s: %d completed step(s) will replay; "
        "by hand: celery-ledger resume %s",
        entry.key,
        won.task_id,
        won.fence,
        won.task_name,
        won.completed_steps,
        entry.key,
    )


def _resend_won(
    batch: Batch,
    entry: Interrupted,
    won: Resuming,
    snapshot: ArgumentSnapshot,
    *,
    lease_seconds: float,
) -> ResumeOutcome:
    """Re-send an entry whose resume this process won; RESUMED, or LOST_RACE (logged) when
    the broker did not take it (the resume lease brings it back to a later sweep)."""
    try:
        send_on(batch, won.task_name, won.task_id, snapshot, deadline_at=won.deadline_at)
        batch.flush()
    except Exception as exc:  # noqa: BLE001 - the lease brings it back to the next sweep
        _log_unsent(entry, won, exc, lease_seconds)
        return ResumeOutcome.LOST_RACE
    _log_resumed(entry, won)
    return ResumeOutcome.RESUMED


def resend_retry(
    store: LedgerStore,
    app: Any,
    entry: Overdue,
    *,
    resend_after: float,
    actor: str = "sweep",
    cipher: SnapshotCipher | None = None,
) -> ResumeOutcome:
    """Re-send an overdue retry (its message never arrived) with its task id and the retry's
    arguments; the entry stays ``retrying``, due again after ``resend_after`` seconds.

    A retry that was only late costs a duplicate message, never a duplicate run: whichever
    delivery claims first RUNs it; the other finds it running (WAIT) or settled (RETURN).
    Returns RESUMED (re-sent), BLOCKED (its snapshot cannot be read) or LOST_RACE.
    """
    snapshot = _snapshot_to_send(store, entry, EntryStatus.RETRYING, cipher=cipher, actor=actor)
    if isinstance(snapshot, ResumeOutcome):
        return snapshot
    won = store.begin_resend(entry.key, entry.fence, resend_after=resend_after, actor=actor)
    if won is None:
        return ResumeOutcome.LOST_RACE
    try:
        send(app, won.task_name, won.task_id, snapshot, deadline_at=won.deadline_at)
    except Exception as exc:  # noqa: BLE001 - due again after resend_after
        log.error(
            "re-send of overdue retry key=%s task_id=%s fence=%s failed (%r); the sweep "
            "tries again in %ss",
            entry.key,
            won.task_id,
            won.fence,
            exc,
            resend_after,
        )
        return ResumeOutcome.LOST_RACE
    log.warning(
        "re-sent overdue retry key=%s task_id=%s fence=%s task=%s (due at %.3f, never "
        "claimed: its message was lost or is late)",
        entry.key,
        won.task_id,
        won.fence,
        won.task_name,
        entry.due_at,
    )
    return ResumeOutcome.RESUMED


def _contained(key: str, what: str, run: Callable[[], ResumeOutcome]) -> ResumeOutcome | None:
    """``run()``, or None (logged) when it fails for this entry alone."""
    try:
        return run()
    except LedgerUnavailable:
        raise  # no entry's fault: the sweep ends, the next one retries
    except Exception:
        log.exception("sweep could not %s key=%s; the sweep goes on", what, key)
        return None


def run_sweep(
    store: LedgerStore,
    app: Any,
    *,
    lease_seconds: float,
    max_resumes: int,
    retention_days: float,
    batch: int = 500,
    actor: str = "sweep",
    cipher: SnapshotCipher | None = None,
    tombstone_days: float = 0.0,
) -> SweepReport:
    """One full sweep: interrupt expired leases, resume or block interrupted work, re-send
    overdue retries, prune.

    Idempotent and safe to run concurrently with itself on SQLite and PostgreSQL. An entry it
    cannot handle is logged and counted (``errors``); the others, and the prune, go on.

    Raises:
        LedgerUnavailable: the ledger went away; the next sweep does the rest.
    """
    cancelled = wake.finish_cancelled(store, app, batch=batch, actor=actor)
    interrupted = store.interrupt_expired(limit=batch, actor=actor)
    candidates = store.list_interrupted(limit=batch, resumable=True)
    expired = expire_passed(store, [c.key for c in candidates], actor=actor)
    candidates = [c for c in candidates if c.key not in expired]
    outcomes: dict[ResumeOutcome | None, list[str]] = {}
    results = resume_batch(
        store,
        app,
        candidates,
        lease_seconds=lease_seconds,
        max_resumes=max_resumes,
        actor=actor,
        cipher=cipher,
    )
    for entry, outcome in zip(candidates, results, strict=True):
        outcomes.setdefault(outcome, []).append(entry.key)
    no_snapshot = store.count_unresumable(limit=batch)
    if no_snapshot:
        log.warning(
            "ledger sweep: %d%s interrupted entr%s without an argument snapshot wait for the "
            "broker or an operator: celery-ledger list --stuck",
            no_snapshot,
            "+" if no_snapshot >= batch else "",
            "y" if no_snapshot == 1 else "ies",
        )
    overdue = store.list_overdue_retries(limit=batch)
    late_expired = expire_passed(store, [o.key for o in overdue], actor=actor)
    overdue = [o for o in overdue if o.key not in late_expired]
    resent: dict[ResumeOutcome | None, list[str]] = {}
    for late in overdue:
        outcome = _contained(
            late.key,
            "re-send the overdue retry of",
            # Due again after a lease, as a resumed entry's marker is: long enough for a
            # worker to claim it, short enough that a lost re-send is soon sent again.
            partial(
                resend_retry,
                store,
                app,
                late,
                resend_after=lease_seconds,
                actor=actor,
                cipher=cipher,
            ),
        )
        resent.setdefault(outcome, []).append(late.key)
    due, woken, wake_errors, due_expired = wake.wake_due(
        store, app, lease_seconds=lease_seconds, batch=batch, actor=actor, cipher=cipher
    )
    outbox_pending, outbox_published, outbox_failed = sweep_outbox(
        store, app, batch=batch, cipher=cipher
    )
    pruned = wake.prune(store, retention_days, tombstone_days, batch=batch)
    store.prune_outbox(limit=batch)
    report = SweepReport(
        interrupted=len(interrupted),
        found=len(candidates),
        resumed=len(outcomes.get(ResumeOutcome.RESUMED, [])),
        blocked=len(outcomes.get(ResumeOutcome.BLOCKED, []))
        + len(resent.get(ResumeOutcome.BLOCKED, [])),
        no_snapshot=no_snapshot,
        pruned=pruned,
        resumed_keys=tuple(outcomes.get(ResumeOutcome.RESUMED, [])),
        overdue=len(overdue),
        resent=len(resent.get(ResumeOutcome.RESUMED, [])),
        errors=len(outcomes.get(None, []))
        + len(resent.get(None, []))
        + wake_errors
        + outbox_failed,
        due=due,
        woken=woken,
        cancelled=cancelled,
        outbox_pending=outbox_pending,
        outbox_published=outbox_published,
        outbox_failed=outbox_failed,
        expired=len(expired) + len(late_expired) + due_expired,
        deferred=len(outcomes.get(ResumeOutcome.DEFERRED, [])),
    )
    if (
        report.interrupted
        or report.found
        or report.pruned
        or report.overdue
        or report.errors
        or report.due
        or report.cancelled
        or report.outbox_pending
        or report.expired
    ):
        log.info("ledger sweep: %s", report.as_dict())
    return report


def boot_sweep(
    store: LedgerStore,
    app: Any,
    *,
    node: str,
    boot: str,
    lease_seconds: float,
    max_resumes: int,
    cipher: SnapshotCipher | None = None,
) -> SweepReport:
    """A worker's boot sweep: its own previous boot is gone, so its entries resume now."""
    mine = store.interrupt_previous_boot(node, boot, actor=node)
    expired = expire_passed(store, [e.key for e in mine], actor=node)
    mine = [e for e in mine if e.key not in expired]
    outcomes = resume_batch(
        store,
        app,
        mine,
        lease_seconds=lease_seconds,
        max_resumes=max_resumes,
        actor=node,
        cipher=cipher,
    )
    report = SweepReport(
        interrupted=len(mine),
        found=len(mine),
        resumed=outcomes.count(ResumeOutcome.RESUMED),
        blocked=outcomes.count(ResumeOutcome.BLOCKED),
        no_snapshot=outcomes.count(ResumeOutcome.NO_SNAPSHOT),
        resumed_keys=tuple(
            e.key for e, o in zip(mine, outcomes, strict=True) if o is ResumeOutcome.RESUMED
        ),
        errors=outcomes.count(None),
        expired=len(expired),
    )
    if mine or expired:
        log.warning("boot sweep of %s: %s", node, report.as_dict())
    return report
