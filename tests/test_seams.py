"""The seams of time, cancellation and recovery, with real ``celery worker`` and ``celery beat``
processes over Redis and PostgreSQL: every re-send is the message the producer meant (the
envelope), and every delivery is admitted by one gate (a pending cancellation, a passed
deadline).

The tasks live in ``tests/seams_app.py``. The producer is a ledger app of the test's own with
the same task classes (only a ``LedgerTask`` records an intent or holds a countdown). Every wait
is bounded and every process is stopped, pass or fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from seams_app import SEAMS_TASKS, register

from celery_ledger import create_app
from celery_ledger.ledger import EntryStatus, LedgerStore
from helpers import business_key, effect_counts, key_of
from procs import TESTS, processes, test_env, wait_for

pytestmark = pytest.mark.processes

#: Countdowns longer than this are held by the ledger in these tests.
THRESHOLD = 2.0
#: Beat's sweep interval in these tests.
SWEEP = 1.0
#: A publish intent's lease in these tests: a message lost in the queue is re-sent after it.
INTENT = 2.0


def seams_env(tmp_path: Path, redis: str, pg_url: str, **extra: Any) -> dict[str, str]:
    settings = {
        "CELERY_LEDGER_HOLD_THRESHOLD_SECONDS": str(THRESHOLD),
        "CELERY_LEDGER_SWEEP_INTERVAL": str(SWEEP),
        "CELERY_LEDGER_LEASE_SECONDS": "6",
        "CELERY_LEDGER_PUBLISH_INTENT_SECONDS": str(INTENT),
    }
    return test_env(tmp_path, broker=redis, ledger_url=pg_url, **{**settings, **extra})


def producer(tmp_path: Path, env: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    app = create_app(
        f"producer-{env['TEST_ID']}",
        data_dir=tmp_path / "producer",
        broker_url=env["CELERY_BROKER_URL"],
        result_backend=env["CELERY_RESULT_BACKEND"],
        ledger_url=env["CELERY_LEDGER_URL"],
        task_default_queue=env["TEST_QUEUE"],
        ledger_hold_threshold_seconds=THRESHOLD,
        ledger_publish_intent_seconds=INTENT,
    )
    return app, register(app)


def effects_of(url: str, tag: str) -> dict[str, int]:
    return {effect: n for (_, effect), n in effect_counts(url, tag).items()}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "celery-ledger"), *args],
        env={**os.environ, **env},
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=120,
    )


def drop_queue(env: dict[str, str]) -> int:
    """The broker loses what it queued for the test (a Redis restart without persistence)."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(env["CELERY_BROKER_URL"])
    try:
        return int(client.delete(env["TEST_QUEUE"]))
    finally:
        client.close()


def status_of(store: LedgerStore, key: str) -> EntryStatus | None:
    try:
        return store.get_entry(key).status
    except KeyError:
        return None


# == the admission gate ======================================================================


def test_a_cancellation_asked_while_a_stepless_body_runs_survives_its_retry(
    tmp_path, redis, pg_url
):
    """guarantees.md § "The seams", fault 2: cancel a stepless task while its first attempt runs;
    that attempt
    then retries (it never meets an effect step's gate). The retry's delivery must find the
    cancellation at its claim: no effect, ``cancelled``, ``TaskCancelled`` to the caller."""
    env = seams_env(tmp_path, redis, pg_url)
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    marker = tmp_path / "go"
    try:
        with processes(tmp_path, env) as procs:
            procs.worker("w1", concurrency=2, extra=SEAMS_TASKS)
            result = tasks["retry_gated"].apply_async(("c1", str(marker)))
            wait_for(
                lambda: Path(f"{marker}.started").exists(), timeout=60, what="the body to start"
            )
            done = cli(env, "cancel", result.id, "--by", "ops", "--reason", "seams test")
            assert done.returncode == 0, done.stderr
            assert "next effect step" in done.stdout, done.stdout
            marker.touch()
            with pytest.raises(Exception) as raised:
                result.get(timeout=60)
            assert type(raised.value).__name__ == "TaskCancelled", raised.value
        assert effects_of(env["TEST_EFFECTS_URL"], "c1") == {}
        assert status_of(store, key_of("seams_app.retry_gated", result.id)) is (
            EntryStatus.CANCELLED
        )
    finally:
        store.dispose()


def test_a_message_that_expired_in_the_queue_is_never_run_by_a_re_send(tmp_path, redis, pg_url):
    """guarantees.md § "The seams", fault 3: a task published with ``expires`` waits in a backlog
    (no worker)
    past it. Celery discards the message when a worker finally fetches it; the publish intent
    must not bring it back without its ``expires``: no effect, the entry ends ``expired``, and
    the sweep stops sending it."""
    env = seams_env(tmp_path, redis, pg_url)
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    try:
        results = [tasks["bare"].apply_async((f"x{i}",), expires=1.5) for i in range(3)]
        keys = [key_of("seams_app.bare", r.id) for r in results]
        time.sleep(2.0)  # the backlog outlives the expiry (and the intents' lease)
        with processes(tmp_path, env) as procs:
            procs.worker("w1", concurrency=2, extra=SEAMS_TASKS)
            procs.beat()
            wait_for(
                lambda: all(status_of(store, k) is EntryStatus.EXPIRED for k in keys),
                timeout=60,
                what="every expired message's entry to settle expired",
            )
            time.sleep(4 * SWEEP)  # a re-send would run within a few sweeps
        for i in range(3):
            assert effects_of(env["TEST_EFFECTS_URL"], f"x{i}") == {}, i
    finally:
        store.dispose()


# == the envelope ============================================================================


def _meant(result: dict[str, Any]) -> None:
    """What ``seams_app.echo`` saw is what the producer sent."""
    assert result["tenant"] == "acme", result
    assert result["timelimit"] == [30, 20], result
    assert result["expires"] is not None, result


def test_a_held_publish_is_sent_when_due_with_every_option_the_producer_gave(
    tmp_path, redis, pg_url
):
    """A countdown past the hold threshold is held by the ledger, not the broker; when the
    sweep sends it, the message carries the producer's headers, time limits and expiry."""
    env = seams_env(tmp_path, redis, pg_url)
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    try:
        with processes(tmp_path, env) as procs:
            procs.worker("w1", concurrency=2, extra=SEAMS_TASKS)
            procs.beat()
            result = tasks["echo"].apply_async(
                ("h1",),
                countdown=THRESHOLD + 1.0,
                headers={"tenant": "acme"},
                time_limit=30,
                soft_time_limit=20,
                expires=600,
            )
            key = key_of("seams_app.echo", result.id)
            assert status_of(store, key) is EntryStatus.SCHEDULED
            _meant(result.get(timeout=60))
        assert effects_of(env["TEST_EFFECTS_URL"], "h1") == {"echo": 1}
    finally:
        store.dispose()


def test_a_published_task_whose_message_the_broker_lost_is_re_sent_as_it_was_meant(
    tmp_path, redis, pg_url
):
    """The broker loses a queued message (no worker yet); the sweep re-sends it from its
    publish intent, with the producer's headers, time limits and expiry."""
    env = seams_env(tmp_path, redis, pg_url)
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    try:
        result = tasks["echo"].apply_async(
            ("l1",), headers={"tenant": "acme"}, time_limit=30, soft_time_limit=20, expires=600
        )
        assert drop_queue(env) == 1
        with processes(tmp_path, env) as procs:
            procs.worker("w1", concurrency=2, extra=SEAMS_TASKS)
            procs.beat()
            _meant(result.get(timeout=60))
        assert effects_of(env["TEST_EFFECTS_URL"], "l1") == {"echo": 1}
        events = [e.event for e in store.entry_events(key_of("seams_app.echo", result.id))]
        assert "resuming" in events, events
    finally:
        store.dispose()


def test_a_producer_behind_the_database_clock_does_not_expire_a_held_task(tmp_path, redis, pg_url):
    """guarantees.md § "The seams", fault 6: a held task's due time is on the database clock; a
    relative
    ``expires`` must be too. A producer 30 s behind the database publishes ``countdown=3600,
    expires=3610``: the stored deadline is after the due time."""
    env = seams_env(tmp_path, redis, pg_url)
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    real = time.time
    try:
        time.time = lambda: real() - 30.0  # type: ignore[assignment]
        try:
            result = tasks["echo"].apply_async(("skew",), countdown=3600, expires=3610)
        finally:
            time.time = real  # type: ignore[assignment]
        entry = store.get_entry(key_of("seams_app.echo", result.id))
        assert entry.status is EntryStatus.SCHEDULED
        assert entry.due_at is not None and entry.deadline_at is not None
        assert entry.deadline_at > entry.due_at, entry.deadline_at - entry.due_at
    finally:
        store.dispose()


# == re-sends know the original may still be queued ==========================================


def queued_messages(env: dict[str, str], queue: str) -> int:
    """Messages Redis holds in ``queue``."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(env["CELERY_BROKER_URL"])
    try:
        return int(client.llen(queue))
    finally:
        client.close()


def test_a_backlog_does_not_multiply_itself(tmp_path, redis, pg_url):
    """guarantees.md § "The seams", fault 14: 50 tasks published to a queue no worker consumes right
    now (its workers are down or busy), a 2 s intent lease and a 2 s task lease, beat sweeping every
    second through a worker of another queue. The intents lapse over and over while their
    messages wait; the sweep must not add a copy of each every lease period: over 16 s the
    queue holds at most 2 messages per task (before: a copy per task every lease period)."""
    env = seams_env(tmp_path, redis, pg_url, CELERY_LEDGER_LEASE_SECONDS="2")
    app, tasks = producer(tmp_path, env)
    backlog = f"backlog-{env['TEST_ID']}"
    n = 50
    seen: list[int] = []
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=SEAMS_TASKS)
        procs.beat()
        for i in range(n):
            tasks["bare"].apply_async((f"b{i}",), queue=backlog)
        until = time.monotonic() + 16.0
        while time.monotonic() < until:
            seen.append(queued_messages(env, backlog))
            time.sleep(0.5)
    print(f"backlog of {n} tasks over 16 s: {seen}")
    assert seen and seen[0] >= n, seen
    assert max(seen) <= 2 * n, seen


# == a reconciler's verdict beside a paused attempt =========================================

#: Rounds of the paused-attempt test; each pauses a fresh worker inside its provider call.
PAUSE_ROUNDS = 2
#: The death grace in that test: a paused attempt's sign of life counts this long.
GRACE = 8.0


def test_a_reconcilers_not_executed_waits_out_a_paused_attempt(tmp_path, redis, pg_url):
    """guarantees.md § "The seams", fault 17: a pool process is SIGSTOPped inside its provider call,
    just after
    its ``started`` row, past its lease. The sweep re-sends the entry; the takeover asks the
    reconciler, which finds no charge yet (``not_executed``). The step must not run again
    while the paused attempt may still land its call: it waits until that attempt has been
    silent for the death grace, then asks again. SIGCONT lands the old call: the provider
    shows one charge, and the task replays it. Every round: exactly one charge."""
    env = seams_env(
        tmp_path,
        redis,
        pg_url,
        CELERY_LEDGER_LEASE_SECONDS="3",
        CELERY_LEDGER_DEATH_GRACE_SECONDS=str(GRACE),
    )
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    url = env["TEST_EFFECTS_URL"]
    later: list[float] = []
    try:
        for r in range(PAUSE_ROUNDS):
            order = f"p{r}"
            key = key_of_order(order)
            with processes(tmp_path, env) as procs:
                w1 = procs.worker(f"w1r{r}", concurrency=1, extra=SEAMS_TASKS)
                procs.beat(f"beat{r}")
                result = tasks["paused_charge"].apply_async((order,), {"seconds": 2.0})
                wait_for(
                    lambda key=key: any(s.name == "charge" for s in steps_of(store, key)),
                    timeout=60,
                    interval=0.05,
                    what="the charge to start on w1",
                )
                paused = time.monotonic()
                w1.pause()
                procs.worker(f"w2r{r}", concurrency=1, extra=SEAMS_TASKS)
                wait_for(
                    lambda key=key: "takeover" in [e.event for e in store.entry_events(key)],
                    timeout=60,
                    what="w2 to take the entry over",
                )
                time.sleep(1.0)  # w2 has asked its reconciler: no charge yet
                w1.resume()
                assert result.get(timeout=120) == f"charge:{order}"
                later.append(time.monotonic() - paused)
            assert effects_of(url, order) == {"charge": 1}, (r, effects_of(url, order))
    finally:
        store.dispose()
    print(f"paused-attempt rounds finished {[round(x, 1) for x in later]} s after the pause")


#: Workers killed while they wait out the grace, at most, in the test below.
WAITER_KILLS = 8


def test_an_attempt_that_waits_out_the_grace_is_no_sign_of_life(tmp_path, redis, pg_url):
    """A step-less body whose worker was SIGKILLed with nothing charged: each takeover asks
    the reconciler (``not_executed``) and waits until the attempt that may have run the body
    has been silent for the death grace. An attempt that only waited never ran the body, so
    its lease renewals must not restart the grace: before, every worker killed while it
    waited (a deploy, a crash loop, verify's settle restarts) made the next one wait a whole
    grace again, and the entry stayed running for as long as the kills went on. Here every
    waiter is killed as soon as it says it waits, up to ``WAITER_KILLS`` times: the entry must
    complete, charged once, within them."""
    env = seams_env(
        tmp_path,
        redis,
        pg_url,
        CELERY_LEDGER_LEASE_SECONDS="2",
        CELERY_LEDGER_DEATH_GRACE_SECONDS=str(GRACE),
        # Not parked as a crash loop (that rule counts interruptions, not the grace).
        CELERY_LEDGER_MAX_RESUMES=str(10 * WAITER_KILLS),
    )
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    url = env["TEST_EFFECTS_URL"]
    order = "waiter"
    marker = tmp_path / "charge-marker"
    key = business_key("seams_app.stepless_charge", order_id=order)
    tasks["stepless_charge"].apply_async((order, str(marker)))
    waited = 0
    try:
        with processes(tmp_path, env) as procs:
            procs.beat()
            first = procs.worker("w0", concurrency=1, extra=SEAMS_TASKS)
            wait_for(
                lambda: Path(f"{marker}.ran").exists(),
                timeout=60,
                what="the first run to start its body",
            )
            first.kill()  # the whole worker: no worker-lost fast path marks it dead
            done = False
            for i in range(WAITER_KILLS + 1):
                w = procs.worker(f"w{i + 1}", concurrency=1, extra=SEAMS_TASKS)
                outcome = wait_for(
                    lambda w=w: _settled_or_waiting(store, key, w),
                    timeout=90,
                    what=f"worker w{i + 1} to wait out the grace or settle the entry",
                )
                assert outcome != EntryStatus.BLOCKED.value, store.get_entry(key).reason
                if outcome == EntryStatus.COMPLETED.value:
                    done = True
                    break
                waited += 1
                w.kill()
            assert done, (
                f"still {store.get_entry(key).status.value} after {waited} waiting attempts "
                "were killed: each restarted the grace"
            )
        assert effect_counts(url, order).get((order, "charge")) == 1, effect_counts(url, order)
    finally:
        store.dispose()
    print(f"the entry completed after {waited} waiting attempt(s) were killed")


def _settled_or_waiting(store: LedgerStore, key: str, worker: Any) -> str | None:
    """``completed`` or ``blocked`` once the entry is; ``waits`` once ``worker`` logged that it
    waits out the grace; else None."""
    status = store.get_entry(key).status
    if status in (EntryStatus.COMPLETED, EntryStatus.BLOCKED):
        return status.value
    return "waits" if "and asks again" in worker.log_text() else None


def key_of_order(order: str) -> str:
    from helpers import business_key

    return business_key("seams_app.paused_charge", order_id=order)


def steps_of(store: LedgerStore, key: str) -> list[Any]:
    try:
        return list(store.load_steps(key))
    except Exception:  # noqa: BLE001 - not claimed yet
        return []


@pytest.mark.rabbitmq
def test_a_backlog_does_not_multiply_itself_on_rabbitmq(tmp_path, rabbitmq, pg_url):
    """Fault 14 on RabbitMQ: the sweep asks the queue's ready count with a passive declare;
    while the backlog waits, no copy is added."""
    from test_rabbitmq import queue_depth

    env = seams_env(tmp_path, rabbitmq, pg_url, CELERY_LEDGER_LEASE_SECONDS="2")
    app, tasks = producer(tmp_path, env)
    backlog = f"backlog-{env['TEST_ID']}"
    n = 30
    seen: list[int] = []
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=SEAMS_TASKS)
        procs.beat()
        for i in range(n):
            tasks["bare"].apply_async((f"r{i}",), queue=backlog)
        until = time.monotonic() + 12.0
        while time.monotonic() < until:
            seen.append(queue_depth(rabbitmq, backlog))
            time.sleep(0.5)
    print(f"RabbitMQ backlog of {n} tasks over 12 s: {seen}")
    assert seen and seen[0] >= n, seen
    assert max(seen) <= 2 * n, seen
