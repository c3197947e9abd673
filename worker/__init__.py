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
    from celery_ledger.attempt import (
        NestedStepError,
        SendRefused,
        StepUsageError,
        TransactionEndedError,
    )
    from celery_ledger.recovery.reconcile import AmbiguousStep, Reconciled
    from celery_ledger.settings import LedgerSettings
    from celery_ledger.task import LedgerTask

#: Public name -> the module that defines it.
_EXPORTS = {
    # Tasks
    "LedgerTask": "celery_ledger.task",
    "StepUsageError": "celery_ledger.attempt",
    "NestedStepError": "celery_ledger.attempt",
    "TransactionEndedError": "celery_ledger.attempt",
    "SendRefused": "celery_ledger.attempt",
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
