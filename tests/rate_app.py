"""Tasks for the process tests of fleet-wide rate limits (design.md § "Fleet-wide rate limits"),
registered on ``tests_app``'s app (``celery -A tests_app worker -I rate_app``).

The "provider" is a table: each call of ``rate_app.provider_call`` inserts one row stamped
with the database's clock (``clock_timestamp()``) at the moment of the call, so the test reads
what the provider saw, not what the ledger admitted.
"""

from __future__ import annotations

import os
import time
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from celery_ledger import LedgerTask
from tests_app import app

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


def _engine() -> Any:
    """This process's engine on the provider's table: no pool, so that twenty pool processes
    keep no idle connection each on a PostgreSQL server shared with other tests."""
    pid = os.getpid()
    if pid not in _engines:
        _engines[pid] = create_engine(
            os.environ["TEST_EFFECTS_URL"].replace("postgresql://", "postgresql+psycopg://", 1),
            poolclass=NullPool,
        )
    return _engines[pid]


_engines: dict[int, Any] = {}


def _call(tag: str, n: int) -> int:
    """Record the call; a server out of connections (shared by the other tests) is waited
    for, at most 40 times 0.25 s, and the call is stamped when it gets through."""
    for attempt in range(40):
        try:
            with _engine().begin() as conn:  # the test created the table
                conn.execute(
                    text(
                        "INSERT INTO rate_provider (tag, n, pid, at) VALUES "
                        "(:t, :n, :p, EXTRACT(EPOCH FROM clock_timestamp()))"
                    ),
                    {"t": tag, "n": n, "p": os.getpid()},
                )
            return n
        except OperationalError:
            if attempt == 39:
                raise
            time.sleep(0.25)
    raise AssertionError("unreachable")


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
