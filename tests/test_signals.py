"""Durable signals (design.md § "Durable signals") with real ``celery worker`` and ``celery beat``
processes over Redis and PostgreSQL: a wait holds no worker slot, survives whole-worker
SIGKILLs before and after its signal, and returns the payload exactly once.

The tasks live in ``tests/time_app.py``; the signals are sent by a ledger app of the test's own
(``test_time.producer``). Every wait is bounded, every process is stopped, pass or fail.
"""

from __future__ import annotations

import pytest
from test_time import (
    effects_of,
    entry_status,
    first_delivery_acked,
    producer,
    time_app_messages,
    time_env,
)
from time_app import TIME_TASKS

from celery_ledger import signal
from celery_ledger.ledger import EntryStatus, LedgerStore
from helpers import event_names, key_of
from procs import processes, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes


def test_a_wait_survives_worker_kills_before_and_after_its_signal_and_takes_it_once(
    tmp_path, redis, pg_url
):
    """The task waits for ``approved``: its attempt ends (no message held, the slot free). The
    worker is SIGKILLed before the signal. A second worker's only slot is busy when the signal
    wakes the task, and that worker is SIGKILLed right after the signal, before it ran it. A
    third worker and beat finish it: the completed step replays, the wait returns the
    payload, and each effect happens once."""
    env = time_env(tmp_path, redis, pg_url, TEST_VISIBILITY_TIMEOUT="3")
    app, _ = producer(tmp_path, env)
    client = client_app(env)
    store = LedgerStore(pg_url)
    marker = tmp_path / "release-w2"
    with processes(tmp_path, env) as procs:
        w1 = procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        result = client.send_task("time_app.waiter", args=("sg", 300.0))
        key = key_of("time_app.waiter", result.id)
        wait_for(
            lambda: entry_status(store, key) is EntryStatus.SLEEPING,
            timeout=60,
            what="the task to wait for its signal",
        )
        assert store.get_entry(key).reason == "signal:approved"
        first_delivery_acked(redis, result.id)
        assert time_app_messages(redis) == [], "a message is held for the waiting task"
        other = client.send_task("time_app.once", args=("during-wait",))
        assert other.get(timeout=30) == "run:during-wait"
        w1.kill()  # SIGKILL, before the signal

        # The second worker's only slot is busy: the woken message cannot run there.
        w2 = procs.worker("w2", concurrency=1, extra=TIME_TASKS)
        busy = client.send_task("time_app.gated", args=("busy", str(marker), 60.0))
        wait_for(lambda: effects_of(pg_url, "busy") == {"s0": 1}, timeout=30, what="w2 to be busy")
        sent = signal(app, key, "approved", {"n": 1, "who": "ops"}, by="tester")
        assert sent.woken and sent.key == key and sent.status is EntryStatus.SLEEPING
        w2.kill()  # SIGKILL, right after the signal, before the woken task ran
        assert effects_of(pg_url, "sg") == {"before": 1}

        marker.write_text("go")
        procs.worker("w3", concurrency=2, extra=TIME_TASKS)
        procs.beat()
        value = result.get(timeout=120)
        busy.get(timeout=60)
    assert value == ["before:sg", {"n": 1, "who": "ops"}, "after:sg"]
    assert effects_of(pg_url, "sg") == {"before": 1, "after": 1}
    steps = [s.name for s in store.load_steps(key)]
    assert steps.count("ledger.wait_for") == 1, steps
    rows = store.signals_of(key)
    assert [(r.name, r.wait, r.timed_out) for r in rows] == [("approved", 1, False)]
    names = event_names(store, key)
    assert "signalled" in names and "woken" in names, names
    store.dispose()


def test_a_signal_before_the_wait_is_taken_at_once_and_a_second_wait_needs_its_own(
    tmp_path, redis, pg_url
):
    """A signal sent while the task runs, before its wait, is kept: the wait returns it
    without sleeping. The next wait for the same name gets nothing from it, sleeps, and
    times out (beat's sweep sends it at the deadline); the replay returns the first payload
    again and the task ends once."""
    env = time_env(tmp_path, redis, pg_url)
    app, _ = producer(tmp_path, env)
    client = client_app(env)
    store = LedgerStore(pg_url)
    marker = tmp_path / "marker"
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        procs.beat()
        result = client.send_task("time_app.waits_twice", args=("tw", str(marker), 2.0))
        key = key_of("time_app.waits_twice", result.id)
        wait_for(
            lambda: entry_status(store, key) is EntryStatus.RUNNING,
            timeout=60,
            what="the task to run",
        )
        sent = signal(app, result.id, "go", ["early"])  # by task id
        assert sent.key == key and not sent.woken and sent.status is EntryStatus.RUNNING
        marker.write_text("go")
        value = result.get(timeout=90)
    assert value == ["s0:tw", ["early"], "timeout", "s1:tw"]
    assert effects_of(pg_url, "tw") == {"s0": 1, "s1": 1}
    rows = store.signals_of(key)
    assert [(r.wait, r.timed_out) for r in rows] == [(1, False), (2, True)]
    reasons = [e.detail for e in store.entry_events(key) if e.event == "settled"]
    assert reasons.count("signal:go") == 1, reasons  # only the second wait slept
    store.dispose()


def test_a_pool_process_killed_between_the_wait_step_and_its_settle_keeps_its_deadline(
    tmp_path, redis, pg_url
):
    """The pool process is SIGKILLed right after the wait's step is recorded (before the entry
    is settled ``sleeping``); the signal comes while nothing runs it. The sweep resumes it
    when its lease lapses: the wait's step replays (one row, one start) and the wait takes
    the signal at once; each effect happens once."""
    once = tmp_path / "crash-once"
    env = time_env(
        tmp_path,
        redis,
        pg_url,
        CELERY_LEDGER_CRASH_AT="step-completed:ledger.wait_for",
        CELERY_LEDGER_CRASH_ONCE=str(once),
    )
    app, _ = producer(tmp_path, env)
    client = client_app(env)
    store = LedgerStore(pg_url)
    fired = tmp_path / "crash-once.step-completed_ledger.wait_for"
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        procs.beat()
        result = client.send_task("time_app.waiter", args=("sc", 300.0))
        key = key_of("time_app.waiter", result.id)
        wait_for(fired.exists, timeout=60, what="the crash point to fire")
        sent = signal(app, key, "approved", "yes")
        assert not sent.woken  # it was not asleep: the resume's wait takes it
        value = result.get(timeout=120)
    assert value == ["before:sc", "yes", "after:sc"]
    assert effects_of(pg_url, "sc") == {"before": 1, "after": 1}
    rows = [s for s in store.load_steps(key) if s.name == "ledger.wait_for"]
    assert len(rows) == 1 and rows[0].attempts == 1, rows
    assert [(r.wait, r.payload) for r in store.signals_of(key)] == [(1, '"yes"')]
    store.dispose()


def test_a_sealed_payload_is_opened_by_the_wait(tmp_path, redis, pg_url, monkeypatch):
    """With ``ledger_snapshot_keys`` set on the sender and the workers, the payload is stored
    sealed and the wait returns it opened."""
    from cryptography.fernet import Fernet

    secret = Fernet.generate_key().decode()
    monkeypatch.setenv("CELERY_LEDGER_SNAPSHOT_KEYS", secret)
    env = time_env(tmp_path, redis, pg_url, CELERY_LEDGER_SNAPSHOT_KEYS=secret)
    app, _ = producer(tmp_path, env)
    client = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        result = client.send_task("time_app.waiter", args=("ss", 300.0))
        key = key_of("time_app.waiter", result.id)
        wait_for(
            lambda: entry_status(store, key) is EntryStatus.SLEEPING,
            timeout=60,
            what="the task to wait for its signal",
        )
        assert signal(app, key, "approved", {"pin": "8642-1357"}).woken
        value = result.get(timeout=60)
    assert value == ["before:ss", {"pin": "8642-1357"}, "after:ss"]
    [row] = store.signals_of(key)
    assert row.payload is not None and row.payload.startswith("fernet:")
    assert "8642" not in row.payload
    store.dispose()
