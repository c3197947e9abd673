"""Tasks for the process tests of fleet-wide rate limits (design.md § "Fleet-wide rate limits"),
registered on ``tests_app``'s app (``celery -A tests_app worker -I rate_app``).

The "provider" is a table: each call of ``rate_app.provider_call`` inserts one row stamped
with the database's clock (``clock_timestamp()``) at the moment of the call, so the test reads
what the provider saw, not what the ledger admitted.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import text

from celery_ledger import LedgerTask
from tests_app import app, effects_engine

#: Worker option that imports this module.
RATE_TASKS = ["-I", "rate_app"]
#: The limit the test holds the fleet to.
LIMIT = "5/s"

_TABLE = (
    "CREATE TABLE IF NOT EXISTS rate_provider "
    "(tag TEXT, n INTEGER, pid INTEGER, at DOUBLE PRECISION)"
)


def provider_calls(url_engine: Any, tag: str) -> list[tuple[int, float]]:
    """Every call the provider saw for ``tag``: (n, database time), in time order."""
    with url_engine.begin() as conn:
        conn.execute(text(_TABLE))
        rows = conn.execute(
            text("SELECT n, at FROM rate_provider WHERE tag = :t ORDER BY at"), {"t": tag}
        ).all()
    return [(int(n), float(at)) for n, at in rows]


def _call(tag: str, n: int) -> int:
    with effects_engine().begin() as conn:
        conn.execute(text(_TABLE))
        conn.execute(
            text(
                "INSERT INTO rate_provider (tag, n, pid, at) VALUES "
                "(:t, :n, :p, EXTRACT(EPOCH FROM clock_timestamp()))"
            ),
            {"t": tag, "n": n, "p": os.getpid()},
        )
    return n


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="rate_app.provider_call",
    side_effect="idempotent",
    ledger_rate_limit=LIMIT,
)
def provider_call(self: LedgerTask, tag: str, n: int) -> int:
    """One call of the provider: idempotent, so a takeover calls it again (and is counted)."""
    return self.step("call", _call, tag, n)
