"""Tasks for ``test_one_runtime``'s worker, registered on ``tests_app``'s app.

A worker loads them with ``celery -A tests_app worker -I runtime_app`` (``RUNTIME_TASKS``).
``parent`` runs a step that sends two children through the outbox (a confirmed publish), the
children are ledgered tasks too, and ``ledger_state`` reports, from the pool process that ran
them, what the ledger keeps on the app.
"""

from __future__ import annotations

import os
from typing import Any

from celery_ledger import LedgerTask, runtime
from tests_app import app

#: Worker option that imports this module.
RUNTIME_TASKS = ["-I", "runtime_app"]


@app.task(shared=False, base=LedgerTask, bind=True, name="runtime_app.child")
def child(self: LedgerTask, n: int) -> int:
    return n


@app.task(shared=False, base=LedgerTask, bind=True, name="runtime_app.parent", key_from=("tag",))
def parent(self: LedgerTask, tag: str) -> list[str]:
    return self.step("notify", lambda: [self.send(child.s(n)) for n in range(2)])


@app.task(shared=False, name="runtime_app.ledger_state")
def ledger_state() -> dict[str, Any]:
    """Every attribute of the app whose name mentions the ledger, and the runtime's parts."""
    return {
        "attributes": sorted(name for name in vars(app) if "ledger" in name.lower()),
        "parts": runtime.runtime_of(app).parts(),
        "pid": os.getpid(),
    }
