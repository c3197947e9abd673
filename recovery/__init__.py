"""Recovery: sweeps, resume and reconcilers. Uses ``celery_ledger.ledger`` and a Celery app it is
given."""

from celery_ledger.recovery.reconcile import AmbiguousStep, Reconciled, Reconciler, ask
from celery_ledger.recovery.sweep import (
    ResumeOutcome,
    SweepReport,
    UnreadableSnapshot,
    boot_sweep,
    read_snapshot,
    resend_retry,
    resume_batch,
    resume_entry,
    run_sweep,
)

__all__ = [
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
    # Reconcilers
    "AmbiguousStep",
    "Reconciled",
    "Reconciler",
    "ask",
]
