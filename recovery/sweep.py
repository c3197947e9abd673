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
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from kombu.utils.json import loads

from celery_ledger.ledger import ArgumentSnapshot, Interrupted, LedgerStore
from celery_ledger.recovery.publish import confirmed

log = logging.getLogger(__name__)


class ResumeOutcome(str, Enum):
    """What ``resume_entry`` did with one interrupted entry."""

    #: Re-enqueued with its original task id and argument snapshot.
    RESUMED = "resumed"
    #: Parked as a crash loop (the ledger's crash-loop rule): an operator must release it.
    BLOCKED = "blocked"
    #: No argument snapshot to re-send from: reported, never guessed; it stays interrupted.
    NO_SNAPSHOT = "no-snapshot"
    #: Another resumer (a sweep, a claim) moved the entry first, or the broker refused the
    #: message; the lease recovery took brings it back to the next sweep.
    LOST_RACE = "lost-race"


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
    #: Interrupted entries without an argument snapshot: reported, never guessed.
    no_snapshot: int = 0
    #: Settled entries deleted by retention.
    pruned: int = 0
    resumed_keys: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["resumed_keys"] = list(self.resumed_keys)
        return data


def resume_entry(
    store: LedgerStore,
    app: Any,
    entry: Interrupted,
    *,
    lease_seconds: float,
    max_resumes: int,
    actor: str = "sweep",
) -> ResumeOutcome:
    """Re-enqueue one interrupted entry, or block it as a crash loop (the ledger decides).

    Returns the ``ResumeOutcome``.
    """
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
    won = store.begin_resume(entry.key, entry.fence, lease_seconds=lease_seconds, actor=actor)
    if won is None:
        return ResumeOutcome.LOST_RACE
    fence, replay = won.fence, won.completed_steps
    # The worker encoded it with kombu's JSON (celery_ledger.codec.encode_snapshot).
    snapshot = ArgumentSnapshot.from_data(loads(won.snapshot) if won.snapshot else {})
    # ledger_redelivery: the entry exists, so the publisher records no publish intent.
    headers: dict[str, Any] = {"ledger_redelivery": True}
    if snapshot.ledger_key is not None:
        headers["ledger_key"] = snapshot.ledger_key
    options: dict[str, Any] = {"task_id": won.task_id, "headers": headers}
    if snapshot.queue:
        options["queue"] = snapshot.queue
    try:
        # Confirmed by the broker (recovery/publish.py): a re-send it never took is not
        # counted as resumed, and the lease begin_resume took brings it back to the next sweep.
        with confirmed(app) as connection:
            app.send_task(
                won.task_name,
                args=list(snapshot.args),
                kwargs=dict(snapshot.kwargs),
                connection=connection,
                **options,
            )
    except Exception as exc:  # noqa: BLE001 - the lease brings it back to the next sweep
        log.error(
            "resume of key=%s task_id=%s fence=%s could not be sent (%r); the next sweep "
            "after %ss retries it",
            entry.key,
            won.task_id,
            fence,
            exc,
            lease_seconds,
        )
        return ResumeOutcome.LOST_RACE
    log.info(
        "resumed key=%s task_id=%s fence=%s task=%s: %d completed step(s) will replay; "
        "by hand: celery-ledger resume %s",
        entry.key,
        won.task_id,
        fence,
        won.task_name,
        replay,
        entry.key,
    )
    return ResumeOutcome.RESUMED


def run_sweep(
    store: LedgerStore,
    app: Any,
    *,
    lease_seconds: float,
    max_resumes: int,
    retention_days: float,
    batch: int = 500,
    actor: str = "sweep",
) -> SweepReport:
    """One full sweep: interrupt expired leases, resume or block interrupted work, prune.

    Idempotent and safe to run concurrently with itself on SQLite and PostgreSQL.
    """
    interrupted = store.interrupt_expired(limit=batch, actor=actor)
    candidates = store.list_interrupted(limit=batch)
    outcomes: dict[ResumeOutcome, list[str]] = {}
    for entry in candidates:
        outcome = resume_entry(
            store, app, entry, lease_seconds=lease_seconds, max_resumes=max_resumes, actor=actor
        )
        outcomes.setdefault(outcome, []).append(entry.key)
    pruned = store.prune_settled(retention_days * 86400.0, limit=batch)
    report = SweepReport(
        interrupted=len(interrupted),
        found=len(candidates),
        resumed=len(outcomes.get(ResumeOutcome.RESUMED, [])),
        blocked=len(outcomes.get(ResumeOutcome.BLOCKED, [])),
        no_snapshot=len(outcomes.get(ResumeOutcome.NO_SNAPSHOT, [])),
        pruned=pruned,
        resumed_keys=tuple(outcomes.get(ResumeOutcome.RESUMED, [])),
    )
    if report.interrupted or report.found or report.pruned:
        log.info("ledger sweep: %s", report.as_dict())
    return report


def boot_sweep(
    store: LedgerStore, app: Any, *, node: str, boot: str, lease_seconds: float, max_resumes: int
) -> SweepReport:
    """A worker's boot sweep: its own previous boot is gone, so its entries resume now."""
    mine = store.interrupt_previous_boot(node, boot, actor=node)
    outcomes = [
        resume_entry(
            store, app, e, lease_seconds=lease_seconds, max_resumes=max_resumes, actor=node
        )
        for e in mine
    ]
    report = SweepReport(
        interrupted=len(mine),
        found=len(mine),
        resumed=outcomes.count(ResumeOutcome.RESUMED),
        blocked=outcomes.count(ResumeOutcome.BLOCKED),
        no_snapshot=outcomes.count(ResumeOutcome.NO_SNAPSHOT),
        resumed_keys=tuple(
            e.key for e, o in zip(mine, outcomes, strict=True) if o is ResumeOutcome.RESUMED
        ),
    )
    if mine:
        log.warning("boot sweep of %s: %s", node, report.as_dict())
    return report
