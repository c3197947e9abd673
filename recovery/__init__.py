"""Recovery: sweeps, resume and reconcilers. Uses ``celery_ledger.ledger`` and a Celery app it is
given (what it uses of each: ``recovery.ports``)."""

# Not ``publish``: that name is the submodule ``celery_ledger.recovery.publish``.
from celery_ledger.recovery.handoff import ResumeOutcome, UnreadableSnapshot, read_snapshot
from celery_ledger.recovery.outbox import PARENT_HEADER, send_child, sweep_outbox
from celery_ledger.recovery.ports import Publisher
from celery_ledger.recovery.reconcile import AmbiguousStep, Reconciled, Reconciler, ask
from celery_ledger.recovery.sweep import (
    SweepReport,
    boot_sweep,
    resend_retry,
    resume_batch,
    resume_entry,
    run_sweep,
)

__all__ = [
    # What recovery is given
    "Publisher",
    # Sweeps
    "SweepReport",
    "run_sweep",
    "boot_sweep",
    "resume_batch",
    "resume_entry",
    "resend_retry",
    "ResumeOutcome",
    "read_snapshot",
    "UnreadableSnapshot",
    # The outbox
    "send_child",
    "sweep_outbox",
    "PARENT_HEADER",
    # Reconcilers
    "AmbiguousStep",
    "Reconciled",
    "Reconciler",
    "ask",
]
