"""Resuming one entry: an interrupted one (``resume_entry``) or an overdue retry
(``resend_retry``), and the pieces the batched resume (``recovery.batch``) shares with them.

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
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from celery_ledger.ledger import (
    ArgumentSnapshot,
    EntryNotFound,
    EntryStatus,
    Interrupted,
    LedgerUnavailable,
    Overdue,
    Resuming,
    SnapshotCipher,
    SnapshotSealError,
)
from celery_ledger.recovery.handoff import (
    ResumeOutcome,
    UnreadableSnapshot,
    park_unreadable,
    read_snapshot,
)
from celery_ledger.recovery.ports import EntryReads, Publisher, ResumeQueries, ResumeStore
from celery_ledger.recovery.publish import Batch
from celery_ledger.recovery.resend import send, send_on

#: The sweep's logger, as before these functions left ``recovery.sweep``: a logging
#: configuration that names it keeps every line of a sweep.
log = logging.getLogger("celery_ledger.recovery.sweep")


def unreadable_reason(exc: UnreadableSnapshot) -> str:
    """The reason an entry whose snapshot cannot be read is parked with."""
    return f"argument snapshot cannot be read: {exc}; release it once you know what it was"


def log_not_here(key: str, fence: int, exc: SnapshotSealError) -> None:
    """A sealed snapshot this process cannot open: not the snapshot's fault but this process's
    (no key, or not the key that sealed it). Parking the entry would need an operator for what
    a configuration fixes: it stays interrupted for a process that holds the key."""
    log.error(
        "cannot resume key=%s fence=%s here: %s; a process with the key resumes it",
        key,
        fence,
        exc,
    )


def _snapshot_at(
    store: EntryReads,
    key: str,
    fence: int,
    status: EntryStatus,
    cipher: SnapshotCipher | None = None,
) -> ArgumentSnapshot | str | None:
    """The entry's decoded snapshot while it is still ``status`` at ``fence``; the reason
    it cannot be read (a str); or None when the entry moved on (a lost race) or this process
    cannot unseal it (``log_not_here``)."""
    try:
        entry = store.get_entry(key)
    except EntryNotFound:
        return None
    if entry.fence != fence or entry.status is not status or entry.snapshot is None:
        return None
    try:
        return read_snapshot(entry.snapshot, cipher)
    except SnapshotSealError as exc:
        log_not_here(key, fence, exc)
        return None
    except UnreadableSnapshot as exc:
        return unreadable_reason(exc)


def snapshot_to_send(
    store: ResumeStore,
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


def screen(
    store: ResumeQueries, entry: Interrupted, *, max_resumes: int, actor: str
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
    store: ResumeStore,
    app: Publisher,
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
    screened = screen(store, entry, max_resumes=max_resumes, actor=actor)
    if screened is not None:
        return screened
    # Decode before the resume begins: an entry whose snapshot no process can read is parked
    # where an operator sees it, not hidden under a resume lease that lapses again and again.
    snapshot = snapshot_to_send(store, entry, EntryStatus.INTERRUPTED, cipher=cipher, actor=actor)
    if isinstance(snapshot, ResumeOutcome):
        return snapshot
    # The CAS re-checks the fence the snapshot was read at, so what is sent is that snapshot.
    won = store.begin_resume(entry.key, entry.fence, lease_seconds=lease_seconds, actor=actor)
    if won is None:
        return ResumeOutcome.LOST_RACE
    with Batch(app) as batch:
        return _resend_won(batch, entry, won, snapshot, lease_seconds=lease_seconds)


def log_unsent(entry: Interrupted, won: Resuming, exc: BaseException, lease_seconds: float) -> None:
    log.error(
        "resume of key=%s task_id=%s fence=%s could not be sent (%r); the next sweep "
        "after %ss retries it",
        entry.key,
        won.task_id,
        won.fence,
        exc,
        lease_seconds,
    )


def log_resumed(entry: Interrupted, won: Resuming) -> None:
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
        log_unsent(entry, won, exc, lease_seconds)
        return ResumeOutcome.LOST_RACE
    log_resumed(entry, won)
    return ResumeOutcome.RESUMED


def resend_retry(
    store: ResumeStore,
    app: Publisher,
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
    snapshot = snapshot_to_send(store, entry, EntryStatus.RETRYING, cipher=cipher, actor=actor)
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


def contained(key: str, what: str, run: Callable[[], ResumeOutcome]) -> ResumeOutcome | None:
    """``run()``, or None (logged) when it fails for this entry alone."""
    try:
        return run()
    except LedgerUnavailable:
        raise  # no entry's fault: the sweep ends, the next one retries
    except Exception:
        log.exception("sweep could not %s key=%s; the sweep goes on", what, key)
        return None
