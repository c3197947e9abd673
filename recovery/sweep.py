"""The recovery sweep: find interrupted work and hand it back to Celery.

Why re-enqueue rather than run the body here (the argument DBOS's ``_recovery.py`` makes): the
sweeper may be beat, a worker booting, or an operator's CLI. None of them is the right process
to execute user code: wrong queue, wrong concurrency limits, wrong time limits, and a crash of
the sweeper would then lose the sweep *and* the work. Re-enqueueing with the original task id
and argument snapshot puts the work back where Celery's own guarantees apply; the claim of that
delivery takes over with a new fence and replays completed steps.

How one entry is resumed, and why (one resumer, the crash-loop rule, entries without a snapshot
or with an unreadable one): ``recovery.resume``; a whole batch at once: ``recovery.batch``.

Why errors are contained per entry: one entry the sweep cannot handle must not cost every other
entry of the batch its resume, nor the retention its prune. An unavailable ledger is no entry's
fault; it ends the sweep (the next one retries).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from celery_ledger.ledger import SnapshotCipher
from celery_ledger.recovery import wake
from celery_ledger.recovery.batch import SEND_CHUNK, resume_batch
from celery_ledger.recovery.handoff import ResumeOutcome, expire_passed
from celery_ledger.recovery.outbox import sweep_outbox
from celery_ledger.recovery.ports import Publisher, SweepStore, WakeStore
from celery_ledger.recovery.resume import contained, resend_retry, resume_entry
from celery_ledger.recovery.wake import PRUNE_BUDGET_SECONDS

__all__ = [
    "SEND_CHUNK",
    "SweepReport",
    "boot_sweep",
    "resend_retry",
    "resume_batch",
    "resume_entry",
    "run_sweep",
]

log = logging.getLogger(__name__)

#: Entry keys by what became of them (None: the entry failed alone, logged).
ByOutcome = dict[ResumeOutcome | None, list[str]]


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
    #: Waiters for a concurrency key's slot served by this sweep (docs/concurrency.md); the
    #: wake pass sent them with the due entries.
    slots_handed: int = 0

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["resumed_keys"] = list(self.resumed_keys)
        return data


def run_sweep(
    store: SweepStore,
    app: Publisher,
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
    # The slots of the holders just interrupted, and any a settling worker did not hand on,
    # go to their keys' waiters; the wake pass below sends them (docs/concurrency.md).
    served = store.hand_over_all(limit=batch, actor=actor)
    found, outcomes, expired = _resume_interrupted(
        store,
        app,
        batch=batch,
        lease_seconds=lease_seconds,
        max_resumes=max_resumes,
        actor=actor,
        cipher=cipher,
    )
    no_snapshot = _count_unresumable(store, batch)
    # Due again after a lease, as a resumed entry's marker is: long enough for a worker to
    # claim it, short enough that a lost re-send is soon sent again.
    overdue, resent, late_expired = _resend_overdue(
        store, app, batch=batch, resend_after=lease_seconds, actor=actor, cipher=cipher
    )
    due, woken, wake_errors, due_expired = wake.wake_due(
        store, app, lease_seconds=lease_seconds, batch=batch, actor=actor, cipher=cipher
    )
    outbox_pending, outbox_published, outbox_failed = sweep_outbox(
        store, app, batch=batch, cipher=cipher
    )
    pruned = wake.prune(store, retention_days, tombstone_days, batch=batch)
    # The outbox rows of the entries just pruned, as many batches as the prune took at most.
    wake.in_batches(
        lambda: store.prune_outbox(limit=batch), batch, time.monotonic() + PRUNE_BUDGET_SECONDS
    )
    report = SweepReport(
        interrupted=len(interrupted),
        found=found,
        resumed=len(outcomes.get(ResumeOutcome.RESUMED, [])),
        blocked=len(outcomes.get(ResumeOutcome.BLOCKED, []))
        + len(resent.get(ResumeOutcome.BLOCKED, [])),
        no_snapshot=no_snapshot,
        pruned=pruned,
        resumed_keys=tuple(outcomes.get(ResumeOutcome.RESUMED, [])),
        overdue=overdue,
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
        expired=expired + late_expired + due_expired,
        deferred=len(outcomes.get(ResumeOutcome.DEFERRED, [])),
        slots_handed=len(served),
    )
    if _worth_logging(report):
        log.info("ledger sweep: %s", report.as_dict())
    return report


def _resume_interrupted(
    store: SweepStore,
    app: Publisher,
    *,
    batch: int,
    lease_seconds: float,
    max_resumes: int,
    actor: str,
    cipher: SnapshotCipher | None,
) -> tuple[int, ByOutcome, int]:
    """Resume up to ``batch`` interrupted entries that have a snapshot; one whose deadline
    passed is settled ``expired`` instead. Returns (found, keys by outcome, expired)."""
    candidates = store.list_interrupted(limit=batch, resumable=True)
    expired = expire_passed(store, [c.key for c in candidates], actor=actor)
    candidates = [c for c in candidates if c.key not in expired]
    results = resume_batch(
        store,
        app,
        candidates,
        lease_seconds=lease_seconds,
        max_resumes=max_resumes,
        actor=actor,
        cipher=cipher,
    )
    outcomes: ByOutcome = {}
    for entry, outcome in zip(candidates, results, strict=True):
        outcomes.setdefault(outcome, []).append(entry.key)
    return len(candidates), outcomes, len(expired)


def _count_unresumable(store: SweepStore, batch: int) -> int:
    """Interrupted entries without an argument snapshot (up to ``batch``), logged: they wait
    for the broker or an operator."""
    no_snapshot = store.count_unresumable(limit=batch)
    if no_snapshot:
        log.warning(
            "ledger sweep: %d%s interrupted entr%s without an argument snapshot wait for the "
            "broker or an operator: celery-ledger list --stuck",
            no_snapshot,
            "+" if no_snapshot >= batch else "",
            "y" if no_snapshot == 1 else "ies",
        )
    return no_snapshot


def _resend_overdue(
    store: SweepStore,
    app: Publisher,
    *,
    batch: int,
    resend_after: float,
    actor: str,
    cipher: SnapshotCipher | None,
) -> tuple[int, ByOutcome, int]:
    """Re-send up to ``batch`` overdue retries, each contained; one whose deadline passed is
    settled ``expired`` instead. Returns (overdue, keys by outcome, expired)."""
    overdue = store.list_overdue_retries(limit=batch)
    expired = expire_passed(store, [o.key for o in overdue], actor=actor)
    overdue = [o for o in overdue if o.key not in expired]
    resent: ByOutcome = {}
    for late in overdue:
        outcome = contained(
            late.key,
            "re-send the overdue retry of",
            partial(
                resend_retry,
                store,
                app,
                late,
                resend_after=resend_after,
                actor=actor,
                cipher=cipher,
            ),
        )
        resent.setdefault(outcome, []).append(late.key)
    return len(overdue), resent, len(expired)


def _worth_logging(report: SweepReport) -> bool:
    """Whether a sweep did or found anything (an idle sweep logs nothing)."""
    return bool(
        report.interrupted
        or report.found
        or report.pruned
        or report.overdue
        or report.errors
        or report.due
        or report.cancelled
        or report.outbox_pending
        or report.expired
        or report.slots_handed
    )


def boot_sweep(
    store: WakeStore,
    app: Publisher,
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
