"""The Celery side of celery-ledger: the task base class, the app wiring, the CLI.

The names below are imported on first access (PEP 562), not with the package: Celery imports
``worker.plugin`` (the ``celery ledger`` sub-command) into every ``celery`` command line, and
that must not drag the ledger, SQLAlchemy and psycopg into workers that do not use them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recovery.reconcile import AmbiguousStep, Reconciled
    from worker.app import create_app, install, sweep_now
    from worker.settings import LedgerSettings
    from worker.task import LedgerTask

#: Public name -> the module that defines it.
_EXPORTS = {
    # Tasks
    "LedgerTask": "worker.task",
    # Reconcilers
    "AmbiguousStep": "recovery.reconcile",
    "Reconciled": "recovery.reconcile",
    # App wiring
    "create_app": "worker.app",
    "install": "worker.app",
    "sweep_now": "worker.app",
    "LedgerSettings": "worker.settings",
}

__all__ = [
    "LedgerTask",
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
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
