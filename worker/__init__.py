"""The Celery side of celery-ledger: the task base class, the app wiring, the CLI."""

from recovery.reconcile import AmbiguousStep, Reconciled
from worker.app import create_app, install, sweep_now
from worker.settings import LedgerSettings
from worker.task import LedgerTask

__all__ = [
    # Tasks
    "LedgerTask",
    # Reconcilers
    "AmbiguousStep",
    "Reconciled",
    # App wiring
    "create_app",
    "install",
    "sweep_now",
    "LedgerSettings",
]
