"""Replay rows under SIGKILL at named crash points (design.md § "Where each crash point
sits"), with real workers.

Broker: Redis; ledger and effects: a PostgreSQL database of the test's own. Each effect is a
row in ``test_effects`` (no unique constraint), so a duplicate is a count of 2.
The crash points fire once (CELERY_LEDGER_CRASH_ONCE); the pool process dies, the worker's
parent marks the entry interrupted (fast path) and Redis redelivers the message (acks_late +
reject_on_worker_lost); the redelivery takes over and replays.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_ledger.ledger import EntryStatus, LedgerStore, StepStatus
from helpers import business_key, effect_counts, event_names, key_of
from procs import processes, test_env
from test_delivery import client_app

pytestmark = pytest.mark.processes

ORDER_RESULT = {"order_id": "o1", "amount": 5, "steps": ["reserve:o1", "charge:o1", "receipt:o1"]}


def run_with_crash(
    tmp_path, redis, pg_url, crash_at, task, args, kwargs=None, expect_failure=False
):
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_CRASH_AT=crash_at,
        CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-once"),
    )
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1)
        result = app.send_task(task, args=args, kwargs=kwargs or {})
        if expect_failure:
            with pytest.raises(Exception) as info:
                result.get(timeout=90)
            value = info.value
        else:
            value = result.get(timeout=90)
        log = worker.log_text()
    # The point fired: its once-marker is made just before the SIGKILL, and the worker's
    # parent saw its pool process die of that signal.
    marker = Path(f"{tmp_path / 'crash-once'}.{crash_at.replace(':', '_')}")
    assert marker.exists(), f"the crash point {crash_at} was never reached"
    assert "SIGKILL" in log, "no pool process died of SIGKILL"
    return value, result.id


@pytest.mark.parametrize("crash_at", ["step-completed:charge", "before-settle"])
def test_crash_after_completed_row_replays_and_finishes_once(tmp_path, redis, pg_url, crash_at):
    value, _ = run_with_crash(tmp_path, redis, pg_url, crash_at, "tests_app.order", ("o1", 5))
    assert value == ORDER_RESULT
    assert effect_counts(pg_url, "o1") == {
        ("o1", "reserve"): 1,
        ("o1", "charge"): 1,
        ("o1", "receipt"): 1,
    }
    store = LedgerStore(pg_url)
    key = business_key("tests_app.order", order_id="o1")
    entry = store.get_entry(key)
    assert entry.status is EntryStatus.COMPLETED
    assert entry.executions == 2 and "interrupted" in event_names(store, key)
    assert store.stats().duplicate_executions == 0


def test_crash_after_started_row_without_reconciler_blocks(tmp_path, redis, pg_url):
    """(a) killed between `started` and the body: may have executed, no reconciler -> blocked."""
    exc, _ = run_with_crash(
        tmp_path,
        redis,
        pg_url,
        "step-started:charge",
        "tests_app.order",
        ("o1", 5),
        expect_failure=True,
    )
    assert type(exc).__name__ == "LedgerBlocked"
    key = business_key("tests_app.order", order_id="o1")
    store = LedgerStore(pg_url)
    entry = store.get_entry(key)
    assert entry.status is EntryStatus.BLOCKED
    assert "'charge' may have executed" in (entry.reason or "")
    assert effect_counts(pg_url, "o1") == {("o1", "reserve"): 1}  # nothing ran twice
    charge = [s for s in store.load_steps(key) if s.name == "charge"]
    assert [s.status for s in charge] == [StepStatus.STARTED]


def test_crash_after_effect_before_checkpoint_is_never_rerun(tmp_path, redis, pg_url):
    """The effect happened, its `completed` row did not: the window DBOS re-executes."""
    exc, _ = run_with_crash(
        tmp_path,
        redis,
        pg_url,
        "step-returned:charge",
        "tests_app.order",
        ("o1", 5),
        expect_failure=True,
    )
    assert type(exc).__name__ == "LedgerBlocked"
    assert effect_counts(pg_url, "o1") == {("o1", "reserve"): 1, ("o1", "charge"): 1}


@pytest.mark.parametrize(
    "answer,crash_at,charges,status",
    [
        # The crash comes after the provider call (the charge exists, its ref was recorded) ...
        ("completed", "step-returned:charge", 1, EntryStatus.COMPLETED),
        ("unknown", "step-returned:charge", 1, EntryStatus.BLOCKED),
        ("raise", "step-returned:charge", 1, EntryStatus.BLOCKED),
        # ... or before it (no charge exists): not_executed lets it run exactly once.
        ("not_executed", "step-started:charge", 1, EntryStatus.COMPLETED),
    ],
)
def test_reconciler_answers(tmp_path, redis, pg_url, answer, crash_at, charges, status):
    blocked = status is EntryStatus.BLOCKED
    value, task_id = run_with_crash(
        tmp_path,
        redis,
        pg_url,
        crash_at,
        "tests_app.reconciled",
        ("r1", answer),
        expect_failure=blocked,
    )
    key = key_of("tests_app.reconciled", task_id)
    store = LedgerStore(pg_url)
    entry = store.get_entry(key)
    assert entry.status is status
    assert effect_counts(pg_url, "r1").get(("r1", "charge"), 0) == charges
    if blocked:
        assert type(value).__name__ == "LedgerBlocked"
        assert "ch_r1" in (entry.reason or "")  # the external ref is named for the operator
    else:
        assert value == ["charge:r1", "receipt:r1"]
        assert store.stats().duplicate_executions == 0


def test_retry_after_completed_effect_does_not_repeat_it(tmp_path, redis, pg_url):
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        result = app.send_task("tests_app.retry_once", args=("rt1",))
        assert result.get(timeout=60) == ["charge:rt1", "email:rt1"]
    assert effect_counts(pg_url, "rt1") == {("rt1", "charge"): 1, ("rt1", "email"): 1}
    store = LedgerStore(pg_url)
    events = event_names(store, key_of("tests_app.retry_once", result.id))
    assert "rerun" in events


def test_loop_records_occurrences_and_replays_them(tmp_path, redis, pg_url):
    value, task_id = run_with_crash(
        tmp_path, redis, pg_url, "step-completed:tick", "tests_app.loop", ("lp1",)
    )
    assert value == ["tick:lp1"] * 3
    store = LedgerStore(pg_url)
    rows = store.load_steps(key_of("tests_app.loop", task_id))
    assert sorted(r.occurrence for r in rows) == [0, 1, 2]
    assert all(r.status is StepStatus.COMPLETED for r in rows)
    assert effect_counts(pg_url, "lp1") == {("lp1", "tick"): 3}


def test_loop_without_crash_records_three_occurrences(tmp_path, redis, pg_url):
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        result = app.send_task("tests_app.loop", args=("lp2",))
        assert result.get(timeout=60) == ["tick:lp2"] * 3
    store = LedgerStore(pg_url)
    key = key_of("tests_app.loop", result.id)
    rows = store.load_steps(key)
    assert [(r.name, r.occurrence) for r in rows] == [("tick", 0), ("tick", 1), ("tick", 2)]
    assert all(r.status is StepStatus.COMPLETED and r.attempts == 1 for r in rows)
    assert len({r.input_hash for r in rows}) == 1  # one input, three occurrences
    assert effect_counts(pg_url, "lp2") == {("lp2", "tick"): 3}
    assert store.get_entry(key).status is EntryStatus.COMPLETED


def test_keyed_step_reruns_with_the_same_provider_key(tmp_path, redis, pg_url):
    """keyed: an ambiguous step re-runs, sending the provider the same idempotency key, so the
    provider (not the ledger) makes the second call a no-op."""
    value, task_id = run_with_crash(
        tmp_path, redis, pg_url, "step-returned:charge", "tests_app.keyed_charge", ("k1",)
    )
    calls = effect_counts(pg_url, "k1")
    assert len(calls) == 1, calls  # one distinct provider key ...
    ((_, sent),) = calls.keys()
    assert calls[("k1", sent)] == 2  # ... sent twice: the crash hid the first call's success
    assert value == sent + ":k1"
    store = LedgerStore(pg_url)
    assert (
        store.get_entry(key_of("tests_app.keyed_charge", task_id)).status is EntryStatus.COMPLETED
    )
    assert store.stats().duplicate_executions == 0  # keyed re-runs are not duplicates
