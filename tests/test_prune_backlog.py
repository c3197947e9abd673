"""Retention keeps up: one sweep prunes more than one batch (design.md § "Recovery", Retention).

The soak (``benchmarks/soak.py``) found the ledger growing without bound once tasks settled
faster than one ``ledger_sweep_batch`` per ``ledger_sweep_interval`` (500 per 30 s by default:
17 tasks/s), because each sweep pruned one batch of settled entries and one of tombstones.
"""

from __future__ import annotations

from sqlalchemy import func, select
from test_recovery import RecordingApp

from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner
from celery_ledger.ledger.schema import entries
from celery_ledger.recovery import run_sweep, wake


def _settle(store: LedgerStore, n: int) -> None:
    for i in range(n):
        key = f"done-{i}"
        claim = store.claim(
            ClaimRequest(key, "t", f"tid-{i}", "h", None, "read", Owner("w", "b", 1), 60.0)
        )
        assert store.settle(key, claim.fence, EntryStatus.COMPLETED, result="1")


def _rows(store: LedgerStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(entries)).scalar_one())


def test_one_sweep_prunes_a_backlog_of_several_batches_and_their_tombstones(ledger_url):
    store = LedgerStore(ledger_url)
    try:
        _settle(store, 7)
        # Past retention (-2 days) and past retention + tombstones (-1 day): all of it goes.
        report = run_sweep(
            store,
            RecordingApp(),
            lease_seconds=60,
            max_resumes=5,
            retention_days=-2,
            tombstone_days=1,
            batch=2,
        )
        assert report.pruned == 7
        assert _rows(store) == 0
    finally:
        store.dispose()


def test_the_prune_of_one_sweep_stops_at_its_time_budget(ledger_url):
    store = LedgerStore(ledger_url)
    try:
        _settle(store, 7)
        # No time at all: one batch of each, as many as a sweep always did: two entries
        # pruned to tombstones, then those two tombstones deleted.
        assert wake.prune(store, -2, 1, batch=2, budget_seconds=0) == 2
        assert _rows(store) == 5
    finally:
        store.dispose()
