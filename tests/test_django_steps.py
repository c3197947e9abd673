"""Django transaction steps under a real worker (design.md § "Transaction steps
and the transactional outbox"): the model writes and the step's
completed row commit together on Django's connection, on PostgreSQL and SQLite.

The worker is ``celery -A django_app worker`` (Django set up, ``tests/djangoproj``); the
ledger is Django's database. ``dj_credit`` has no unique constraint, so a duplicate is a
second row. Crash points fire once; the redelivery (Redis) takes over and replays.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from celery_ledger.harness.processes import ProcessGroup
from celery_ledger.ledger import EntryStatus, LedgerStore, StepStatus
from celery_ledger.ledger.engine import make_engine
from helpers import business_key, event_names
from procs import READY_TIMEOUT, STOP_TIMEOUT, TESTS, test_env
from test_delivery import client_app

pytest.importorskip("django")

pytestmark = pytest.mark.processes

CREATE = {
    "sqlite": "CREATE TABLE dj_credit (id INTEGER PRIMARY KEY AUTOINCREMENT, "
    "order_id VARCHAR(64) NOT NULL, kind VARCHAR(16) NOT NULL)",
    "postgresql": "CREATE TABLE dj_credit (id SERIAL PRIMARY KEY, "
    "order_id VARCHAR(64) NOT NULL, kind VARCHAR(16) NOT NULL)",
}


def credits(url: str, order_id: str) -> dict[str, int]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT kind, COUNT(*) FROM dj_credit WHERE order_id = :o GROUP BY kind"),
                {"o": order_id},
            ).all()
    finally:
        engine.dispose()
    return {k: int(n) for k, n in rows}


def make_table(url: str) -> LedgerStore:
    store = LedgerStore(url)
    store.ensure_ready()
    with store.engine.begin() as conn:
        conn.execute(text(CREATE[store.dialect.name]))
    return store


@contextmanager
def django_worker(tmp_path: Path, env: dict[str, str]) -> Iterator[Any]:
    """One ``celery -A django_app worker``, ready, stopped on leaving."""
    group = ProcessGroup(
        tmp_path,
        app="django_app",
        env=env,
        cwd=TESTS,
        pythonpath=[TESTS],
        stop_timeout=STOP_TIMEOUT,
    )
    with group:
        yield group.worker(
            "w1",
            queue=env["TEST_QUEUE"],
            node=f"w1-{env['TEST_ID']}@%h",
            concurrency=1,
            heartbeat=True,
        ).wait_ready(READY_TIMEOUT)


@pytest.mark.parametrize(
    "crash_at",
    [
        "txn-written:credit",  # the model row written in atomic(), not committed
        "step-completed:credit",  # committed with its row
        "txn-written:bonus",  # inside the caller's atomic block, not committed
        "step-completed:bonus",  # the savepoint released; the outer block not yet committed
    ],
)
def test_sigkill_in_a_django_transaction_step_writes_exactly_once(
    tmp_path: Path, redis: str, ledger_url: str, crash_at: str
) -> None:
    store = make_table(ledger_url)
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=ledger_url,
        TEST_DJANGO_DB=ledger_url,
        CELERY_LEDGER_CRASH_AT=crash_at,
        CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-once"),
    )
    app = client_app(env)
    with django_worker(tmp_path, env) as worker:
        value = app.send_task("django_app.credit", args=("d1",)).get(timeout=90)
        log = worker.log_text()
    marker = Path(f"{tmp_path / 'crash-once'}.{crash_at.replace(':', '_')}")
    assert marker.exists(), f"the crash point {crash_at} was never reached"
    assert "SIGKILL" in log
    assert value == ["credit:d1", "bonus:d1"]
    assert credits(ledger_url, "d1") == {"credit": 1, "outer": 1, "bonus": 1}
    key = business_key("django_app.credit", order_id="d1")
    entry = store.get_entry(key)
    assert entry.status is EntryStatus.COMPLETED and entry.executions == 2
    assert "blocked" not in event_names(store, key)
    assert store.stats().duplicate_executions == 0


def test_a_django_step_whose_block_asks_for_a_rollback_fails_the_task(
    tmp_path: Path, redis: str, ledger_url: str
) -> None:
    """guarantees.md § "Bad input", item 6: ``transaction.set_rollback(True)`` in the step's
    function rolled the
    model write and the step's row back, and the step returned as if done: the task
    completed with its credit lost. The step refuses instead: the task fails, nothing is
    written, no row says the step is done."""
    store = make_table(ledger_url)
    env = test_env(tmp_path, broker=redis, ledger_url=ledger_url, TEST_DJANGO_DB=ledger_url)
    app = client_app(env)
    with django_worker(tmp_path, env):
        result = app.send_task("django_app.rolled_back", args=("r1",))
        with pytest.raises(Exception) as info:
            result.get(timeout=90)
    assert type(info.value).__name__ == "TransactionEndedError", info.value
    assert "set_rollback" in str(info.value)
    assert credits(ledger_url, "r1") == {}
    key = business_key("django_app.rolled_back", order_id="r1")
    entry = store.get_entry(key)
    assert entry.status is EntryStatus.FAILED, entry
    assert all(s.status is not StepStatus.COMPLETED for s in store.load_steps(key))
