"""The sweep's durable-time pass (design.md § "Durable time"): publish what is due, settle pending
cancellations.

``scheduled`` entries (a countdown the ledger holds) and ``sleeping`` ones (``self.sleep()``)
whose due time passed are found on the due-time index (``LedgerStore.list_due``), handed to
exactly one waker by a compare-and-set (``begin_wake``) and re-sent with their original task id
and argument snapshot, confirmed by the broker (``recovery.publish``). The woken entry is
``running`` under the resume marker with a lease: if the message is lost, the lease expires and
the stale-lease sweep resumes it like any interrupted entry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from celery_ledger.ledger import (
    EntryStatus,
    LedgerUnavailable,
    SnapshotCipher,
    SnapshotSealError,
)
from celery_ledger.ledger.schedule import PRUNED_FAILURE, cancelled_failure
from celery_ledger.recovery.handoff import (
    ResumeOutcome,
    UnreadableSnapshot,
    expire_passed,
    park_unreadable,
    read_snapshot,
)
from celery_ledger.recovery.ports import Publisher, TimeQueries, WakeStore
from celery_ledger.recovery.resend import send

log = logging.getLogger(__name__)


def wake_entry(
    store: WakeStore,
    app: Publisher,
    key: str,
    fence: int,
    status: EntryStatus,
    snapshot_text: str | None,
    *,
    task_id: str,
    lease_seconds: float,
    actor: str,
    only_due: bool = True,
    cipher: SnapshotCipher | None = None,
) -> ResumeOutcome:
    """Wake one ``scheduled``/``sleeping`` entry at ``fence``: CAS it to running, then send it.

    Returns RESUMED (sent), NO_SNAPSHOT, BLOCKED (its snapshot cannot be read) or LOST_RACE
    (another waker, a cancel, or a refused publish: the lease brings it back).
    """
    if snapshot_text is None:
        return ResumeOutcome.NO_SNAPSHOT
    try:
        snapshot = read_snapshot(snapshot_text, cipher)
    except SnapshotSealError as exc:
        # This process lacks the key (``resume.log_not_here``): a process with it wakes it.
        log.error("cannot wake key=%s fence=%s here: %s", key, fence, exc)
        return ResumeOutcome.LOST_RACE
    except UnreadableSnapshot as exc:
        reason = f"argument snapshot cannot be read: {exc}; release it once you know what it was"
        return park_unreadable(store, key, task_id, fence, reason, status=status, actor=actor)
    woke = store.begin_wake(
        key, fence, status, lease_seconds=lease_seconds, actor=actor, only_due=only_due
    )
    if woke is None:
        return ResumeOutcome.LOST_RACE
    won, _ = woke
    try:
        # The deadline rides along (``resend.message``), so the claim checks it at once.
        send(app, won.task_name, won.task_id, snapshot, deadline_at=won.deadline_at)
    except Exception as exc:  # noqa: BLE001 - the lease brings it back to a later sweep
        log.error(
            "wake of key=%s task_id=%s could not be sent (%r); resumed after %ss",
            key,
            won.task_id,
            exc,
            lease_seconds,
        )
        return ResumeOutcome.LOST_RACE
    log.info("woke %s key=%s task_id=%s fence=%s", status.value, key, won.task_id, won.fence)
    return ResumeOutcome.RESUMED


def wake_due(
    store: WakeStore,
    app: Publisher,
    *,
    lease_seconds: float,
    batch: int,
    actor: str = "sweep",
    cipher: SnapshotCipher | None = None,
) -> tuple[int, int, int, int]:
    """Send every due ``scheduled``/``sleeping`` entry (up to ``batch``); one whose deadline
    passed meanwhile is settled ``expired`` instead (``handoff.expire_passed``).

    Returns (due, woken, errors, expired). One entry's failure is logged and counted; an
    unavailable ledger ends the pass (the next sweep goes on).
    """
    due = store.list_due(limit=batch)
    expired = expire_passed(store, [d.key for d in due], actor=actor)
    woken = errors = 0
    for entry in due:
        if entry.key in expired:
            continue
        try:
            current = store.get_entry(entry.key)
            if current.fence != entry.fence or current.status is not entry.status:
                continue
            outcome = wake_entry(
                store,
                app,
                entry.key,
                entry.fence,
                entry.status,
                current.snapshot,
                task_id=entry.task_id,
                lease_seconds=lease_seconds,
                actor=actor,
                cipher=cipher,
            )
        except LedgerUnavailable:
            raise
        except Exception:
            log.exception("sweep could not wake key=%s; the sweep goes on", entry.key)
            errors += 1
            continue
        woken += outcome is ResumeOutcome.RESUMED
    return len(due), woken, errors, len(expired)


def finish_cancelled(
    store: TimeQueries, app: Publisher, *, batch: int, actor: str = "sweep"
) -> int:
    """Settle ``cancelled`` the entries with a pending cancellation that no live attempt will
    settle (interrupted, asleep, running past its lease); one whose lost attempt left an effect
    step ``started`` is parked ``blocked`` instead (``LedgerStore.finish_cancelled``). Returns
    how many it finished."""
    return store.finish_cancelled(
        cancelled_failure("cancelled; no attempt was running it"), limit=batch, actor=actor
    )


#: How long one sweep's prune may go on, batch after batch (design.md § "Recovery", its
#: Retention item). Each batch is one transaction of ``ledger_sweep_batch`` entries; 10 s of
#: them is many times what a worker settles in a sweep interval (the soak: 120 tasks/s x 30 s,
#: about 3,600 entries, 8 batches), while a larger backlog (retention just shortened, a long
#: outage) is left to the next sweeps rather than holding the pool process that runs the sweep.
PRUNE_BUDGET_SECONDS = 10.0


def prune(
    store: WakeStore,
    retention_days: float,
    tombstone_days: float,
    *,
    batch: int,
    budget_seconds: float = PRUNE_BUDGET_SECONDS,
) -> int:
    """Retention: prune settled entries past ``retention_days``, to tombstones when
    ``tombstone_days`` > 0, and delete tombstones past ``retention_days + tombstone_days``,
    one batch per transaction, until a batch comes back short or ``budget_seconds`` ran out
    (one batch of each at least). Returns how many settled entries were pruned.

    Batch after batch, not one: one batch per sweep (500 per 30 s by default) is a ceiling of
    17 settled tasks a second, and a ledger that settled faster grew without bound
    (docs/benchmarks.md § "Soak")."""
    deadline = time.monotonic() + budget_seconds
    older = retention_days * 86400.0
    if tombstone_days <= 0:
        return in_batches(lambda: store.prune_settled(older, limit=batch), batch, deadline)
    pruned = in_batches(
        lambda: store.prune_settled(older, limit=batch, tombstone=PRUNED_FAILURE), batch, deadline
    )
    gone = (retention_days + tombstone_days) * 86400.0
    in_batches(lambda: store.prune_tombstones(gone, limit=batch), batch, deadline)
    return pruned


def in_batches(prune_one: Callable[[], int], batch: int, deadline: float) -> int:
    """Call ``prune_one`` (one transaction, up to ``batch`` rows) until it prunes fewer than a
    batch or ``deadline`` (``time.monotonic()``) passed; at least once. Returns the total."""
    total = 0
    while True:
        n = prune_one()
        total += n
        if n < batch or time.monotonic() >= deadline:
            return total
