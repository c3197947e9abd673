"""celery-ledger: durable, fenced, at-most-once side effects and crash recovery for Celery.

``celery_ledger`` is the Celery side (the task base class, the app wiring, signals, Flower
glue; the repository's ``worker/``). Its subpackages: ``celery_ledger.ledger`` (the store,
no Celery), ``celery_ledger.recovery`` (sweeps, resume, reconcilers), ``celery_ledger.cli``
(the operator CLI) and ``celery_ledger.harness`` (``demo`` and ``verify``).

The names below are imported on first access (PEP 562), not with the package: Celery imports
``celery_ledger.cli.plugin`` (the ``celery ledger`` sub-command) into every ``celery`` command
line, and that must not drag the ledger, SQLAlchemy and psycopg into workers that do not use
them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_ledger.app import create_app, install, sweep_now
    from celery_ledger.errors import (
        NestedStepError,
        SendRefused,
        SignalTimeout,
        StepUsageError,
        TransactionEndedError,
    )
    from celery_ledger.ledger.errors import (
        AdmissionRefused,
        KeyConflict,
        KeyPruned,
        LedgerBlocked,
        LedgerError,
        LedgerUnavailable,
        TaskCancelled,
        TaskExpired,
    )
    from celery_ledger.recovery.reconcile import AmbiguousStep, Reconciled
    from celery_ledger.settings import LedgerSettings
    from celery_ledger.signals import signal
    from celery_ledger.task import LedgerTask

#: Public name -> the module that defines it.
_EXPORTS = {
    # Tasks
    "LedgerTask": "celery_ledger.task",
    # Errors: the task API's (the runtime's tree) ...
    "StepUsageError": "celery_ledger.errors",
    "NestedStepError": "celery_ledger.errors",
    "TransactionEndedError": "celery_ledger.errors",
    "SendRefused": "celery_ledger.errors",
    "SignalTimeout": "celery_ledger.errors",
    # ... and the ledger's that a caller or a body meets
    "LedgerError": "celery_ledger.ledger.errors",
    "LedgerUnavailable": "celery_ledger.ledger.errors",
    "LedgerBlocked": "celery_ledger.ledger.errors",
    "KeyConflict": "celery_ledger.ledger.errors",
    "AdmissionRefused": "celery_ledger.ledger.errors",
    "TaskCancelled": "celery_ledger.ledger.errors",
    "TaskExpired": "celery_ledger.ledger.errors",
    "KeyPruned": "celery_ledger.ledger.errors",
    # Signals
    "signal": "celery_ledger.signals",
    # Reconcilers
    "AmbiguousStep": "celery_ledger.recovery.reconcile",
    "Reconciled": "celery_ledger.recovery.reconcile",
    # App wiring
    "create_app": "celery_ledger.app",
    "install": "celery_ledger.app",
    "sweep_now": "celery_ledger.app",
    "LedgerSettings": "celery_ledger.settings",
}

__all__ = [
    "LedgerTask",
    "StepUsageError",
    "NestedStepError",
    "TransactionEndedError",
    "SendRefused",
    "SignalTimeout",
    "LedgerError",
    "LedgerUnavailable",
    "LedgerBlocked",
    "KeyConflict",
    "AdmissionRefused",
    "TaskCancelled",
    "TaskExpired",
    "KeyPruned",
    "signal",
    "AmbiguousStep",
    "Reconciled",
    "create_app",
    "install",
    "sweep_now",
    "LedgerSettings",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_ledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
