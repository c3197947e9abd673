"""``resume`` of a sleeping entry wakes it now (guarantees.md § "Bad input", item 9).

``celery-ledger resume KEY`` of a ``sleeping`` entry used to send it, and the replayed sleep
step put it straight back to sleep with the same wake time. Now the resume ends the sleep: the
task goes on after its ``self.sleep`` at once. Real worker, no beat (nothing else would wake
it for ten minutes), the CLI as a real process; Redis and PostgreSQL.
"""

from __future__ import annotations

import json

import pytest
from test_cli import celery_cli, run
from test_store_contract import request
from test_time import entry_status, time_env
from time_app import TIME_TASKS

from celery_ledger.ledger import EntryStatus, LedgerStore, StepStatus
from celery_ledger.ledger.schedule import SLEEP_STEP
from helpers import event_names, key_of
from procs import processes, wait_for
from test_delivery import client_app

#: Far longer than the test may take: only the resume can end this sleep in time.
SLEEP_SECONDS = 600.0


@pytest.mark.processes
def test_resume_of_a_sleeping_entry_wakes_it_now(tmp_path, redis, pg_url) -> None:
    env = time_env(tmp_path, redis, pg_url)
    app = client_app(env)
    store = LedgerStore(pg_url)
    try:
        with processes(tmp_path, env) as procs:
            procs.worker("w1", concurrency=1, extra=TIME_TASKS)
            result = app.send_task("time_app.sleeper", args=("hand", SLEEP_SECONDS))
            key = key_of("time_app.sleeper", result.id)
            wait_for(
                lambda: entry_status(store, key) is EntryStatus.SLEEPING,
                timeout=60,
                what="the task to sleep",
            )
            asleep = store.get_entry(key)
            assert asleep.due_at is not None and asleep.due_at - store.now() > 500
            out = run(celery_cli("resume", key), env).stdout
            assert f"sent {key}" in out, out
            value = result.get(timeout=60)
        assert value == ["before:hand", "after:hand"]
        entry = store.get_entry(key)
        assert entry.status is EntryStatus.COMPLETED, entry
        names = event_names(store, key)
        # Woken once, and settled once after it (completed): it did not go back to sleep.
        assert names.count("woken") == 1, names
        assert names[names.index("woken") :].count("settled") == 1, names
        steps = [s.name for s in store.load_steps(key)]
        assert steps.count("ledger.sleep") == 1, steps
    finally:
        store.dispose()


# -- the store (SQLite and PostgreSQL) ---------------------------------------------------------


def _asleep(store: LedgerStore, key: str, wake: float) -> int:
    """``key`` asleep until ``wake`` after a completed step and its sleep step; its fence."""
    claim = store.claim(request(key, task_id=f"t-{key}"))
    assert store.write_step(
        key, claim.fence, ("before", "ih", 0), seq=1, status=StepStatus.COMPLETED, output='"b"'
    )
    assert store.write_step(
        key,
        claim.fence,
        (SLEEP_STEP, "ih", 0),
        seq=2,
        status=StepStatus.COMPLETED,
        output=json.dumps(wake),
    )
    assert store.settle(key, claim.fence, EntryStatus.SLEEPING, due_at=wake)
    return claim.fence


def _sleep_output(store: LedgerStore, key: str) -> float:
    (row,) = [s for s in store.load_steps(key) if s.name == SLEEP_STEP]
    return float(json.loads(row.output or "null"))


def test_a_wake_by_hand_ends_the_sleep_and_a_due_wake_keeps_it(store: LedgerStore) -> None:
    now = store.now()
    fence = _asleep(store, "k-hand", now + 3600)
    woke = store.begin_wake(
        "k-hand", fence, EntryStatus.SLEEPING, lease_seconds=60, actor="ops", only_due=False
    )
    assert woke is not None
    assert now - 5 <= _sleep_output(store, "k-hand") <= store.now() + 1
    (other,) = [s for s in store.load_steps("k-hand") if s.name == "before"]
    assert other.output == '"b"'
    # The sweep wakes only what is due, and leaves the sleep's wake time as it was.
    due = _asleep(store, "k-due", now - 1)
    assert store.begin_wake("k-due", due, EntryStatus.SLEEPING, lease_seconds=60) is not None
    assert _sleep_output(store, "k-due") == now - 1
