"""Durable time (design.md § "Durable time"), with real ``celery worker`` and ``celery beat``
processes over Redis and
PostgreSQL: long countdowns held by the ledger, durable sleep, deadlines, cancellation.

The tasks live in ``tests/time_app.py``. The producer is a ledger app of the test's own
(``producer``) with the same task classes, since only a ``LedgerTask`` holds a countdown in the
ledger. Every wait is bounded, every process is stopped, pass or fail; timings are printed,
never asserted.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from time_app import TIME_TASKS, register

from celery_ledger import TaskCancelled, TaskExpired, create_app
from celery_ledger.ledger import EntryStatus, LedgerStore
from helpers import effect_counts, event_names, key_of
from procs import WaitTimeout, processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

#: Countdowns longer than this are held by the ledger in these tests (the default is 600 s).
THRESHOLD = 2.0
#: Beat's sweep interval in these tests: a due entry is sent within about this long.
SWEEP = 1.0


def time_env(tmp_path: Path, redis: str, pg_url: str, **extra: Any) -> dict[str, str]:
    return test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_HOLD_THRESHOLD_SECONDS=str(THRESHOLD),
        CELERY_LEDGER_SWEEP_INTERVAL=str(SWEEP),
        CELERY_LEDGER_LEASE_SECONDS="6",
        # Two of these leases, not two default ones: a takeover whose reconciler says "not
        # executed" of a SIGKILLed attempt's step waits out this grace since that attempt's
        # last sign of life (design.md § "The death-signal gate"); at the default 120 s it held
        # one task of the long-countdown test for two minutes.
        CELERY_LEDGER_DEATH_GRACE_SECONDS="12",
        **extra,
    )


def producer(tmp_path: Path, env: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """A ledger app publishing to the test's broker and queue, with the time_app tasks."""
    app = create_app(
        f"producer-{env['TEST_ID']}",
        data_dir=tmp_path / "producer",
        broker_url=env["CELERY_BROKER_URL"],
        result_backend=env["CELERY_RESULT_BACKEND"],
        ledger_url=env["CELERY_LEDGER_URL"],
        task_default_queue=env["TEST_QUEUE"],
        ledger_hold_threshold_seconds=THRESHOLD,
    )
    if env.get("TEST_VISIBILITY_TIMEOUT"):
        app.conf.broker_transport_options = {
            "visibility_timeout": float(env["TEST_VISIBILITY_TIMEOUT"])
        }
    return app, register(app)


def effects_of(url: str, tag: str) -> dict[str, int]:
    return {effect: n for (_, effect), n in effect_counts(url, tag).items()}


def redis_messages(url: str) -> list[dict[str, Any]]:
    """Every message Redis holds for any queue or as unacked (kombu's ``unacked`` hash)."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(url)
    try:
        found: list[dict[str, Any]] = []
        for raw in client.hvals("unacked"):
            message = json.loads(raw)[0]  # [message, exchange, routing key]
            found.append(json.loads(message) if isinstance(message, (str, bytes)) else message)
        for name in client.keys("*"):
            if client.type(name) == b"list":
                found += [json.loads(m) for m in client.lrange(name, 0, -1)]
        return found
    finally:
        client.close()


def time_app_messages(url: str) -> list[dict[str, Any]]:
    return [m for m in redis_messages(url) if str(m["headers"].get("task")).startswith("time_app")]


def first_delivery_acked(url: str, task_id: str) -> None:
    """Wait until the worker acks the first delivery of ``task_id`` (no ETA, no retry): the
    entry is settled (held, sleeping) inside the task, and the message stays in kombu's
    ``unacked`` hash until the task returns, a moment later. Any other message of the task
    (a published retry or countdown carries an ETA) is not waited for."""

    def first(m: dict[str, Any]) -> bool:
        h = m["headers"]
        return h.get("id") == task_id and not h.get("retries") and h.get("eta") is None

    wait_for(
        lambda: not [m for m in time_app_messages(url) if first(m)],
        timeout=30,
        what=f"the first delivery of {task_id} to be acked",
    )


def entry_status(store: LedgerStore, key: str) -> EntryStatus | None:
    try:
        return store.get_entry(key).status
    except KeyError:
        return None


# == (1) 200 long countdowns, 2 workers, short visibility timeout, SIGKILLs ===================


def test_long_countdowns_are_held_by_the_ledger_and_run_once_through_worker_kills(
    tmp_path, redis, pg_url
):
    """200 tasks with a countdown beyond the hold threshold: nothing is published while they
    wait (Redis holds no message for them, unacked or queued), beat's sweep sends each when
    due with its task id, and each runs exactly once although both workers are SIGKILLed and
    Redis's visibility timeout is shorter than the countdowns. Lateness against the due time
    is printed, not asserted."""
    n = 200
    env = time_env(tmp_path, redis, pg_url, TEST_VISIBILITY_TIMEOUT="3")
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    sent: dict[str, tuple[str, float]] = {}  # tag -> (task id, due on the database clock)
    with processes(tmp_path, env) as procs:
        workers = {
            "w1": procs.worker("w1", concurrency=2, extra=TIME_TASKS),
            "w2": procs.worker("w2", concurrency=2, extra=TIME_TASKS),
        }
        start = time.time()
        for i in range(n):
            tag = f"cd-{i}"
            countdown = 4.0 + (i % 40) * 0.25  # due 4 s to 14 s from now
            result = tasks["once"].apply_async((tag, 0.05), countdown=countdown)
            entry = store.get_entry(key_of("time_app.once", result.id))
            assert entry.status is EntryStatus.SCHEDULED, (tag, entry.status)
            assert entry.due_at is not None
            sent[tag] = (result.id, entry.due_at)
        print(f"\npublished {n} held tasks in {time.time() - start:.1f}s")
        held = time_app_messages(redis)
        assert held == [], f"Redis holds {len(held)} message(s) for held tasks: {held[:2]}"
        procs.beat()
        # SIGKILL each worker once while tasks come due, and start another in its place.
        for name, proc in workers.items():
            time.sleep(3.0)
            proc.kill()
            procs.worker(f"{name}b", concurrency=2, extra=TIME_TASKS)

        def all_done() -> bool:
            counts = effect_counts(pg_url)
            return sum(1 for tag in sent if counts.get((tag, "run"))) == n

        try:
            wait_for(all_done, timeout=240, what=f"all {n} held tasks to run")
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}; entries by status: {store.stats().by_status}") from None
        wait_for(lambda: not time_app_messages(redis), timeout=60, what="Redis to hold no message")
        for tag, (task_id, _) in sent.items():
            wait_for(
                lambda tid=task_id: (
                    entry_status(store, key_of("time_app.once", tid)) is EntryStatus.COMPLETED
                ),
                timeout=60,
                what=f"{tag} to settle completed",
            )
    counts = effect_counts(pg_url)
    dupes = {tag: counts.get((tag, "run"), 0) for tag in sent if counts.get((tag, "run")) != 1}
    assert dupes == {}, f"not exactly once: {dupes}"
    assert store.stats().duplicate_executions == 0
    late = _lateness(pg_url, sent)
    print(
        f"lateness vs due over {n} tasks (sweep interval {SWEEP}s, two worker SIGKILLs): "
        f"min {min(late):.2f}s median {statistics.median(late):.2f}s "
        f"p95 {sorted(late)[int(0.95 * len(late)) - 1]:.2f}s max {max(late):.2f}s"
    )
    store.dispose()


def _lateness(url: str, sent: dict[str, tuple[str, float]]) -> list[float]:
    from sqlalchemy import text

    from celery_ledger.ledger.engine import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT tag, MIN(at) FROM test_effects WHERE effect = 'run' GROUP BY tag")
            ).all()
    finally:
        engine.dispose()
    at = {tag: float(t) for tag, t in rows}
    return [at[tag] - due for tag, (_, due) in sent.items() if tag in at]


# == held retries ===========================================================================


def test_a_long_retry_countdown_is_held_by_the_ledger_and_replays_completed_steps(
    tmp_path, redis, pg_url
):
    """``self.retry(countdown=)`` beyond the threshold publishes nothing: the entry is
    ``scheduled`` with its due time, the sweep sends it, ``charge`` replays and ``email`` runs
    once."""
    env = time_env(tmp_path, redis, pg_url)
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        result = app.send_task("time_app.retry_far", args=("rf", 5.0))
        key = key_of("time_app.retry_far", result.id)
        wait_for(
            lambda: entry_status(store, key) is EntryStatus.SCHEDULED,
            timeout=60,
            what="the retry to be held (scheduled)",
        )
        first_delivery_acked(redis, result.id)
        assert time_app_messages(redis) == [], "the held retry was published"
        procs.beat()
        value = result.get(timeout=90)
    assert value == ["charge:rf", "email:rf"]
    assert effects_of(pg_url, "rf") == {"charge": 1, "email": 1}
    assert "woken" in event_names(store, key)
    store.dispose()


def test_a_woken_task_that_retries_far_is_held_again(tmp_path, redis, pg_url):
    """A held task, woken by the sweep (its message carries the ledger's re-send header),
    retries with a long countdown: the retry is held too (the entry is ``scheduled`` again and
    woken a second time), not published for a worker to hold."""
    env = time_env(tmp_path, redis, pg_url)
    _, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        procs.beat()
        result = tasks["retry_far"].apply_async(("rf2", 4.0), countdown=3.0)
        value = result.get(timeout=90)
    key = key_of("time_app.retry_far", result.id)
    assert value == ["charge:rf2", "email:rf2"]
    assert effects_of(pg_url, "rf2") == {"charge": 1, "email": 1}
    names = event_names(store, key)
    assert names.count("woken") == 2, names
    store.dispose()


def test_a_stepless_task_whose_long_retry_was_held_runs_again_when_woken(tmp_path, redis, pg_url):
    """A task without steps (``non_idempotent``: its body is the effect) retries once with a
    countdown the ledger holds. Its attempt ended cleanly (settled ``scheduled``), so nothing
    is ambiguous: the sweep wakes it, the claim re-runs it as a retry, and it completes with
    the body run twice, never parked ``blocked``."""
    env = time_env(tmp_path, redis, pg_url)
    app = client_app(env)
    store = LedgerStore(pg_url)
    ended = (EntryStatus.COMPLETED, EntryStatus.BLOCKED, EntryStatus.FAILED)
    try:
        with processes(tmp_path, env) as procs:
            procs.worker("w1", concurrency=1, extra=TIME_TASKS)
            result = app.send_task("time_app.bare_retry_far", args=("brf", 4.0))
            key = key_of("time_app.bare_retry_far", result.id)
            wait_for(
                lambda: entry_status(store, key) is EntryStatus.SCHEDULED,
                timeout=60,
                what="the retry to be held (scheduled)",
            )
            procs.beat()
            wait_for(lambda: entry_status(store, key) in ended, timeout=90, what="the task to end")
            entry = store.get_entry(key)
            names = event_names(store, key)
            assert entry.status is EntryStatus.COMPLETED, (entry.status, entry.reason, names)
            assert result.get(timeout=30) == "body:brf"
        assert effects_of(pg_url, "brf") == {"body": 2}
        assert "woken" in names, names
    finally:
        store.dispose()


def test_a_held_retry_with_throw_false_does_not_hold_the_next_task_in_the_process(
    tmp_path, redis, pg_url
):
    """Task A calls ``self.retry(countdown=<held>, throw=False)`` and returns; task B, next in
    the same pool process (``-c 1``), retries with a short countdown. B's retry is published
    and claimed as Celery's: B completes (body twice). A's held retry never reaches B."""
    env = time_env(tmp_path, redis, pg_url)
    app = client_app(env)
    store = LedgerStore(pg_url)
    ended = (
        EntryStatus.COMPLETED,
        EntryStatus.BLOCKED,
        EntryStatus.FAILED,
        EntryStatus.SCHEDULED,
    )
    try:
        with processes(tmp_path, env) as procs:
            procs.worker("w1", concurrency=1, extra=TIME_TASKS)
            first = app.send_task("time_app.quiet_retry", args=("qa", 3600.0))
            assert first.get(timeout=60) == "body:qa"
            retried = [
                m
                for m in time_app_messages(redis)
                if m["headers"].get("id") == first.id and m["headers"].get("retries")
            ]
            assert retried == [], "the held throw=False retry was published"
            second = app.send_task("time_app.retry_soon", args=("qb", 0.5))
            key_b = key_of("time_app.retry_soon", second.id)
            # B's retry is due 0.5 s after its first run; a held B would be due in an hour.
            wait_for(
                lambda: entry_status(store, key_b) in ended,
                timeout=60,
                what="task B to settle (completed, or held: scheduled)",
            )
            entry_b = store.get_entry(key_b)
            assert entry_b.status is EntryStatus.COMPLETED, (
                entry_b.status,
                entry_b.due_at,
                event_names(store, key_b),
            )
            assert second.get(timeout=30) == "body:qb"
            # The Retry a throw=False call returned, raised by the body, is held as ever.
            third = app.send_task("time_app.quiet_retry", args=("qc", 3600.0, True))
            key_c = key_of("time_app.quiet_retry", third.id)
            wait_for(
                lambda: entry_status(store, key_c) is EntryStatus.SCHEDULED,
                timeout=60,
                what="the raised throw=False retry to be held",
            )
        assert effects_of(pg_url, "qb") == {"body": 2}
        assert effects_of(pg_url, "qa") == {"body": 1}
        pids = {pid for tag in ("qa", "qb") for pid in _effect_pids(pg_url, tag)}
        assert len(pids) == 1, f"A and B ran in more than one pool process: {pids}"
        entry_a = store.get_entry(key_of("time_app.quiet_retry", first.id))
        assert entry_a.status is EntryStatus.COMPLETED, entry_a.status
        due_at = store.get_entry(key_c).due_at
        assert due_at is not None and due_at - store.now() > 3000, due_at
        assert effects_of(pg_url, "qc") == {}
    finally:
        store.dispose()


def _effect_pids(url: str, tag: str) -> set[int]:
    from sqlalchemy import text

    from celery_ledger.ledger.engine import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT pid FROM test_effects WHERE tag = :t"), {"t": tag})
            return {int(r[0]) for r in rows}
    finally:
        engine.dispose()


# == (2) durable sleep ======================================================================


def test_sleep_ends_the_attempt_frees_the_slot_and_resumes_after_a_worker_kill(
    tmp_path, redis, pg_url
):
    """A task sleeps 3 s between two effect steps. While it sleeps, the worker's only slot
    runs another task (the attempt ended, no slot is held) and the worker is SIGKILLed; a new
    worker starts. The task resumes after the sleep (beat's sweep sends it), the completed step
    replays, and each effect happens once."""
    env = time_env(tmp_path, redis, pg_url, TEST_VISIBILITY_TIMEOUT="3")
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        first = procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        result = app.send_task("time_app.sleeper", args=("sl", 3.0))
        key = key_of("time_app.sleeper", result.id)
        wait_for(
            lambda: entry_status(store, key) is EntryStatus.SLEEPING,
            timeout=60,
            what="the task to sleep",
        )
        assert effects_of(pg_url, "sl") == {"before": 1}
        first_delivery_acked(redis, result.id)
        assert time_app_messages(redis) == [], "a message is held for the sleeping task"
        other = app.send_task("time_app.once", args=("during-sleep",))
        assert other.get(timeout=30) == "run:during-sleep"
        assert entry_status(store, key) is EntryStatus.SLEEPING
        first.kill()
        procs.worker("w2", concurrency=1, extra=TIME_TASKS)
        procs.beat()
        value = result.get(timeout=90)
    assert value == ["before:sl", "after:sl"]
    assert effects_of(pg_url, "sl") == {"before": 1, "after": 1}
    names = event_names(store, key)
    assert "woken" in names, names
    steps = [s.name for s in store.load_steps(key)]
    assert steps.count("ledger.sleep") == 1, steps
    store.dispose()


def test_a_pool_process_killed_right_after_the_sleep_step_never_sleeps_twice(
    tmp_path, redis, pg_url
):
    """The pool process is SIGKILLed right after the sleep step is recorded (before the entry
    is settled ``sleeping``). The resumed attempt replays the sleep step's wake time instead
    of sleeping again from now, and each effect happens once."""
    once = tmp_path / "crash-once"
    env = time_env(
        tmp_path,
        redis,
        pg_url,
        CELERY_LEDGER_CRASH_AT="step-completed:ledger.sleep",
        CELERY_LEDGER_CRASH_ONCE=str(once),
    )
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        procs.beat()
        result = app.send_task("time_app.sleeper", args=("sk", 4.0))
        value = result.get(timeout=120)
    key = key_of("time_app.sleeper", result.id)
    assert value == ["before:sk", "after:sk"]
    assert effects_of(pg_url, "sk") == {"before": 1, "after": 1}
    assert Path(f"{once}.step-completed_ledger.sleep").exists(), "the crash point did not fire"
    rows = [s for s in store.load_steps(key) if s.name == "ledger.sleep"]
    assert len(rows) == 1 and rows[0].attempts == 1, rows
    print("\nevents:", event_names(store, key))
    store.dispose()


# == (3) deadlines ==========================================================================


def test_a_deadline_that_passes_in_the_queue_settles_expired_and_runs_no_effect(
    tmp_path, redis, pg_url
):
    """A task whose ``ledger_deadline`` header passes while it waits behind a long task on a
    one-slot worker settles ``expired`` after its claim; its effect never happens. The same for
    a task whose own ``deadline`` option (seconds after its publish) passes."""
    env = time_env(tmp_path, redis, pg_url)
    app = client_app(env)
    _, tasks = producer(tmp_path, env)  # publish intents: the entry exists from the publish
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        blocker = app.send_task("tests_app.slow_effect", args=("blocker", 5.0))
        wait_for(lambda: effects_of(pg_url, "blocker"), timeout=60, what="the long task to start")
        late = app.send_task(
            "time_app.once", args=("late",), headers={"ledger_deadline": time.time() + 1.0}
        )
        option = tasks["soon"].delay("soon")  # the task's own ``deadline`` (1 s)
        with pytest.raises(Exception) as raised:
            late.get(timeout=60)
        with pytest.raises(Exception) as raised_option:
            option.get(timeout=60)
        blocker.get(timeout=60)
    assert type(raised.value).__name__ == TaskExpired.__name__, raised.value
    assert type(raised_option.value).__name__ == TaskExpired.__name__, raised_option.value
    entry = store.get_entry(key_of("time_app.once", late.id))
    assert entry.status is EntryStatus.EXPIRED, entry.status
    assert store.get_entry(key_of("time_app.soon", option.id)).status is EntryStatus.EXPIRED
    assert effects_of(pg_url, "late") == {}
    assert effects_of(pg_url, "soon") == {}
    store.dispose()


def test_a_held_task_whose_expires_passes_before_it_is_due_settles_expired_unrun(
    tmp_path, redis, pg_url
):
    """A held task (no steps: its body is the effect) whose ``expires`` passes before its due
    time: when it comes due, recovery's door (the admission gate) finds its deadline passed and
    settles it expired instead of sending it; the body never runs."""
    env = time_env(tmp_path, redis, pg_url)
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        procs.beat()
        result = tasks["bare"].apply_async(("bx",), countdown=4.0, expires=2.0)
        key = key_of("time_app.bare", result.id)
        assert entry_status(store, key) is EntryStatus.SCHEDULED
        wait_for(
            lambda: entry_status(store, key) is EntryStatus.EXPIRED,
            timeout=60,
            what="the held task to settle expired",
        )
    assert effects_of(pg_url, "bx") == {}
    assert event_names(store, key) == ["scheduled", "expired"], event_names(store, key)
    store.dispose()


# == (4) cancellation =======================================================================


def _cli(env: dict[str, str], *args: str) -> Any:
    import os
    import subprocess
    import sys

    from procs import TESTS

    return subprocess.run(
        [str(Path(sys.executable).parent / "celery-ledger"), *args],
        env={**os.environ, **env},
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _cancel_round(
    tmp_path: Path,
    env: dict[str, str],
    app: Any,
    tasks: dict[str, Any],
    store: LedgerStore,
    round_: str,
) -> tuple[str, str]:
    """Start a batch of gated tasks, cancel one mid-body (CLI) and one scheduled (revoke)."""
    marker = tmp_path / f"go-{round_}"
    batch = [tasks["gated"].apply_async((f"{round_}-g{i}", str(marker))) for i in range(3)]
    victim = batch[1]
    wait_for(
        lambda: effects_of(env["TEST_EFFECTS_URL"], f"{round_}-g1").get("s0") == 1,
        timeout=60,
        what="the victim to run its first step",
    )
    done = _cli(env, "cancel", victim.id, "--by", "ops", "--reason", f"round {round_}")
    assert done.returncode == 0, done.stderr
    assert "next effect step" in done.stdout, done.stdout
    scheduled = tasks["once"].apply_async((f"{round_}-sched",), countdown=30)
    assert entry_status(store, key_of("time_app.once", scheduled.id)) is EntryStatus.SCHEDULED
    scheduled.revoke()
    marker.touch()
    with pytest.raises(Exception) as raised:
        victim.get(timeout=60)
    assert type(raised.value).__name__ == TaskCancelled.__name__, raised.value
    for i in (0, 2):
        assert batch[i].get(timeout=60) == [f"s0:{round_}-g{i}", f"s1:{round_}-g{i}"]
    return victim.id, scheduled.id


def test_cancel_stops_a_running_task_at_its_next_step_and_a_scheduled_one_never_starts(
    tmp_path, redis, pg_url
):
    """Cancel one task of a running batch mid-body (``celery-ledger cancel``) and one that is
    scheduled (``AsyncResult.revoke()``): neither performs a further effect, both are
    ``cancelled`` in ``list``. Again after restarting every worker; and a cancellation recorded
    while a worker is SIGKILLed survives into the next worker."""
    env = time_env(tmp_path, redis, pg_url, TEST_VISIBILITY_TIMEOUT="3")
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    url = env["TEST_EFFECTS_URL"]
    ids: list[str] = []
    with processes(tmp_path, env) as procs:
        w1 = procs.worker("w1", concurrency=3, extra=TIME_TASKS)
        beat = procs.beat()
        ids += _cancel_round(tmp_path, env, app, tasks, store, "r1")
        w1.stop()
        beat.stop()
        w2 = procs.worker("w2", concurrency=3, extra=TIME_TASKS)
        procs.beat("beat2")
        ids += _cancel_round(tmp_path, env, app, tasks, store, "r2")
        # A cancellation recorded while the task runs, then its worker is SIGKILLed before the
        # next step: the next worker's attempt must not perform it.
        marker = tmp_path / "go-r3"
        victim = tasks["gated"].apply_async(("r3-g", str(marker)))
        wait_for(lambda: effects_of(url, "r3-g").get("s0") == 1, timeout=60, what="r3 s0")
        done = _cli(env, "cancel", victim.id, "--by", "ops", "--reason", "before a kill")
        assert done.returncode == 0, done.stderr
        w2.kill()
        procs.worker("w3", concurrency=2, extra=TIME_TASKS)
        marker.touch()
        key = key_of("time_app.gated", victim.id)
        wait_for(
            lambda: entry_status(store, key) is EntryStatus.CANCELLED,
            timeout=90,
            what="r3 to settle cancelled",
        )
        ids.append(victim.id)
        time.sleep(2 * SWEEP)  # a late delivery of any of them would show as an effect
    for tag in ("r1-g1", "r2-g1", "r3-g"):
        assert effects_of(url, tag) == {"s0": 1}, (tag, effects_of(url, tag))
    for tag in ("r1-sched", "r2-sched"):
        assert effects_of(url, tag) == {}, tag
    listed = _cli(env, "list", "--status", "cancelled", "--json")
    assert listed.returncode == 0, listed.stderr
    cancelled = {e["task_id"] for e in json.loads(listed.stdout)["entries"]}
    assert set(ids) <= cancelled, (ids, cancelled)
    store.dispose()


# == (5) key windows and tombstones =========================================================


def test_an_ambiguous_keyed_step_past_its_key_window_goes_to_its_reconciler(
    tmp_path, redis, pg_url
):
    """A ``keyed`` charge whose provider forgets keys at once (``provider_key_ttl``): its pool
    process is SIGKILLed after the charge returned and before it was recorded. The resume must
    not re-run the charge blindly with the stale key; the reconciler finds the charge and it
    replays: charge once, receipt once."""
    once = tmp_path / "crash-once"
    env = time_env(
        tmp_path,
        redis,
        pg_url,
        CELERY_LEDGER_CRASH_AT="step-returned:charge",
        CELERY_LEDGER_CRASH_ONCE=str(once),
    )
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        procs.beat()
        result = app.send_task("time_app.keyed_charge", args=("kc",))
        value = result.get(timeout=120)
        log = worker.log_text()
    assert value == ["charge:kc", "receipt:kc"]
    assert Path(f"{once}.step-returned_charge").exists(), "the crash point did not fire"
    assert effects_of(pg_url, "kc") == {"charge": 1, "receipt": 1}
    assert "past provider_key_ttl" in log, "the key window was not consulted"
    store.dispose()


def test_a_keyed_body_without_steps_past_its_key_window_is_not_run_again(tmp_path, redis, pg_url):
    """guarantees.md § "The seams", fault 11: a ``keyed`` task that records no steps
    (``provider_key_ttl`` 1 s, no
    reconciler) performs its effect, holds on 1.5 s, and its pool process is SIGKILLed before
    the settle. The takeover comes after the window, judged from the entry's first execution:
    the body is not re-run with a key the provider may have forgotten; the entry is blocked
    with a reason that names the window. The effect happened once."""
    once = tmp_path / "crash-once"
    env = time_env(
        tmp_path,
        redis,
        pg_url,
        CELERY_LEDGER_CRASH_AT="before-settle",
        CELERY_LEDGER_CRASH_ONCE=str(once),
    )
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        sent = app.send_task("time_app.keyed_bare", args=("kb", 1.5))
        key = key_of("time_app.keyed_bare", sent.id)
        wait_for(
            lambda: (
                Path(f"{once}.before-settle").exists()
                and entry_status(store, key)
                in (EntryStatus.BLOCKED, EntryStatus.COMPLETED, EntryStatus.FAILED)
            ),
            timeout=60,
            what="the crashed keyed body to be taken over and decided",
        )
        log = worker.log_text()
    entry = store.get_entry(key)
    assert effects_of(pg_url, "kb") == {"bare": 1}, "the body ran again past its key window"
    assert entry.status is EntryStatus.BLOCKED, (entry.status, entry.reason)
    assert "provider_key_ttl" in (entry.reason or ""), entry.reason
    assert entry.executions == 2 and "takeover" in event_names(store, key)
    assert "past provider_key_ttl" in log, "the key window was not consulted"
    store.dispose()


def test_a_pruned_key_delivered_again_finds_its_tombstone_and_does_not_run(tmp_path, redis, pg_url):
    """Retention prunes a completed and a failed entry to tombstones (beat's sweep, retention
    under a second). The same task ids delivered again do not run: the completed one returns,
    the failed one raises ``KeyPruned``; each effect happened once."""
    env = time_env(tmp_path, redis, pg_url, CELERY_LEDGER_RETENTION_DAYS="0.00001")
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        done = app.send_task("time_app.once", args=("tomb-ok",))
        assert done.get(timeout=60) == "run:tomb-ok"
        failed = app.send_task("time_app.fails", args=("tomb-bad",))
        with pytest.raises(Exception):  # noqa: B017 - the task's own ValueError
            failed.get(timeout=60)
        keys = {
            "ok": key_of("time_app.once", done.id),
            "bad": key_of("time_app.fails", failed.id),
        }
        procs.beat()
        for key in keys.values():
            wait_for(
                lambda k=key: store.get_entry(k).tombstone_at is not None,
                timeout=60,
                what=f"{key[:12]} to be pruned to a tombstone",
            )
            assert store.load_steps(key) == ()
        app.send_task("time_app.once", args=("tomb-ok",), task_id=done.id)
        app.send_task("time_app.fails", args=("tomb-bad",), task_id=failed.id)
        for key in keys.values():
            wait_for(
                lambda k=key: "returned" in event_names(store, k),
                timeout=60,
                what=f"the late delivery of {key[:12]} to find its tombstone",
            )
    assert effects_of(pg_url, "tomb-ok") == {"run": 1}
    assert effects_of(pg_url, "tomb-bad") == {"run": 1}
    ok, bad = store.get_entry(keys["ok"]), store.get_entry(keys["bad"])
    assert ok.status is EntryStatus.COMPLETED and ok.result is None, ok
    assert bad.status is EntryStatus.FAILED and "KeyPruned" in (bad.error or ""), bad.error
    store.dispose()


def test_a_revoke_from_an_app_without_the_ledger_is_recorded_by_the_worker(tmp_path, redis, pg_url):
    """``revoke()`` sent by a plain Celery app (no ledger on the producer): the worker's
    ``revoke`` control command records the cancellation, and the running task stops at its
    next effect step, ``cancelled``; it stays cancelled after the worker restarts."""
    env = time_env(tmp_path, redis, pg_url)
    app = client_app(env)  # plain Celery: its revoke is only Celery's broadcast
    store = LedgerStore(pg_url)
    url = env["TEST_EFFECTS_URL"]
    marker = tmp_path / "go"
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        result = app.send_task("time_app.gated", args=("rv", str(marker)))
        key = key_of("time_app.gated", result.id)
        wait_for(lambda: effects_of(url, "rv").get("s0") == 1, timeout=60, what="rv s0")
        app.control.revoke(result.id)
        wait_for(
            lambda: store.get_entry(key).cancel_requested_at is not None,
            timeout=30,
            what="the worker to record the revoke in the ledger",
        )
        marker.touch()
        wait_for(
            lambda: entry_status(store, key) is EntryStatus.CANCELLED,
            timeout=60,
            what="rv to settle cancelled",
        )
        worker.stop()
        procs.worker("w2", concurrency=1, extra=TIME_TASKS)
        # Delivered again to a worker that never saw the revoke: still not run.
        app.send_task("time_app.gated", args=("rv", str(marker)), task_id=result.id)
        wait_for(
            lambda: "returned" in event_names(store, key),
            timeout=60,
            what="the new delivery to find the entry cancelled",
        )
    assert effects_of(url, "rv") == {"s0": 1}
    assert store.get_entry(key).cancel_by.startswith("revoke@")
    store.dispose()


def test_a_malformed_deadline_header_runs_the_task_without_that_deadline(tmp_path, redis, pg_url):
    """guarantees.md § "Bad input", items 13 and 14: a ``ledger_deadline`` header that is no finite
    time (from a
    producer that bypassed ``apply_async``'s check) is ignored by the worker with a warning:
    the task runs once, as if it had no such header; the claim never fails on it."""
    env = time_env(tmp_path, redis, pg_url)
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=TIME_TASKS)
        sent = {
            tag: app.send_task("time_app.once", args=(tag,), headers={"ledger_deadline": raw})
            for tag, raw in (("hdr-abc", "abc"), ("hdr-nan", float("nan")), ("hdr-list", [1]))
        }
        for result in sent.values():
            result.get(timeout=60)
    for tag, result in sent.items():
        entry = store.get_entry(key_of("time_app.once", result.id))
        assert entry.status is EntryStatus.COMPLETED, (tag, entry.status)
        assert effects_of(pg_url, tag) == {"run": 1}, tag
    store.dispose()
