"""The batched sweep (design.md § "The sweep resumes in batches"): the re-sends of a sweep go to a
real Redis over one
producer, in pipelines; none counts as sent unless Redis took it; a bulk step that fails falls
back to one entry at a time. Every wait is bounded."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu.utils.json import loads
from test_recovery import make_interrupted

from celery_ledger.ledger import RESUME_OWNER, EntryStatus, LedgerStore
from celery_ledger.recovery import run_sweep
from celery_ledger.recovery.sweep import SEND_CHUNK


@pytest.fixture
def redis_app(redis: str) -> Iterator[Celery]:
    app = Celery("sweep-batch", broker=redis, set_as_current=False)
    app.conf.task_default_queue = "sweep-batch"
    app.conf.broker_connection_retry_on_startup = False
    # A refused publish fails at once instead of being retried for seconds.
    app.conf.task_publish_retry = False
    try:
        yield app
    finally:
        app.close()


def queued(app: Celery) -> list[dict[str, Any]]:
    """The messages on the app's default queue (not consumed)."""
    with app.connection_for_write() as conn:
        client = conn.default_channel.client
        return [loads(raw) for raw in client.lrange("sweep-batch", 0, -1)]


def redis_client(app: Celery) -> Any:
    with app.connection_for_write() as conn:
        return conn.default_channel.client


def test_a_batched_sweep_sends_each_entry_to_redis_once_with_its_task_id(ledger_url, redis_app):
    n = SEND_CHUNK * 2 + 7  # three pipelines, the last one partial
    store = LedgerStore(ledger_url)
    try:
        keys = make_interrupted(store, n)
        report = run_sweep(store, redis_app, lease_seconds=60, max_resumes=5, retention_days=7)
        assert (report.interrupted, report.resumed, report.errors) == (n, n, 0)
        messages = queued(redis_app)
        ids = sorted(m["headers"]["id"] for m in messages)
        assert ids == sorted(f"tid-{i}" for i in range(n))
        assert all(m["headers"]["ledger_redelivery"] is True for m in messages)
        for key in keys:
            entry = store.get_entry(key)
            assert (entry.status, entry.owner) == (EntryStatus.RUNNING, RESUME_OWNER)
        # Each won CAS wrote its own audit event, one per entry.
        with store.engine.connect() as conn:
            resuming = conn.exec_driver_sql(
                "SELECT count(*) FROM ledger_events WHERE event = 'resuming'"
            ).scalar_one()
        assert resuming == n
        # A second sweep finds nothing: every entry is held by the resume marker's lease.
        again = run_sweep(store, redis_app, lease_seconds=60, max_resumes=5, retention_days=7)
        assert (again.found, again.resumed) == (0, 0) and len(queued(redis_app)) == n
    finally:
        store.dispose()


@pytest.mark.parametrize("where", ["declare", "flush"])
def test_re_sends_redis_refuses_count_as_unsent_and_a_later_sweep_sends_them(
    ledger_url, redis, where
):
    """Redis refuses the re-sends, so no entry may count as resumed; their resume leases lapse
    and a later sweep, with Redis fixed, sends each of them once.

    ``declare``: the queue's key holds a string, so kombu's declare (an LLEN) fails at each send.
    ``flush``: a Redis user of this test's own may do everything but LPUSH, so the sends are
    buffered and the pipeline's execution is refused (NOPERM): the whole chunk is unsent.
    """
    from urllib.parse import urlsplit, urlunsplit

    import redis as redis_py

    parts = urlsplit(redis)
    admin = redis_py.Redis.from_url(redis)
    user = f"sweep-batch-{os.getpid()}"
    url = redis
    if where == "flush":
        admin.acl_setuser(
            user,
            enabled=True,
            passwords=["+pw"],
            keys=["*"],
            channels=["*"],
            commands=["+@all", "-lpush"],
        )
        url = urlunsplit(parts._replace(netloc=f"{user}:pw@{parts.hostname}:{parts.port}"))
    refusing = Celery("sweep-batch-refused", broker=url, set_as_current=False)
    refusing.conf.task_default_queue = "sweep-batch"
    refusing.conf.task_publish_retry = False
    fixed = Celery("sweep-batch", broker=redis, set_as_current=False)
    fixed.conf.task_default_queue = "sweep-batch"
    store = LedgerStore(ledger_url)
    try:
        keys = make_interrupted(store, 5)
        if where == "declare":
            admin.set("sweep-batch", "not a list")
        refused = run_sweep(store, refusing, lease_seconds=0.5, max_resumes=5, retention_days=7)
        assert (refused.interrupted, refused.found, refused.resumed) == (5, 5, 0)
        assert admin.type("sweep-batch") in (b"none", b"string")  # nothing was pushed
        admin.delete("sweep-batch")
        for key in keys:  # held by the resume marker until its lease lapses
            assert store.get_entry(key).owner == RESUME_OWNER
        resumed = 0
        deadline = time.monotonic() + 30
        while resumed < 5 and time.monotonic() < deadline:
            time.sleep(0.6)
            report = run_sweep(store, fixed, lease_seconds=60, max_resumes=5, retention_days=7)
            resumed += report.resumed
        assert resumed == 5
        assert sorted(m["headers"]["id"] for m in queued(fixed)) == [f"tid-{i}" for i in range(5)]
        # A lapsed resume marker is a slow queue, not a crash: no interruption was counted.
        assert {store.get_entry(k).interruptions for k in keys} == {1}
    finally:
        store.dispose()
        refusing.close()
        fixed.close()
        if where == "flush":
            admin.acl_deluser(user)
        admin.close()


def test_a_bulk_step_that_fails_falls_back_to_one_entry_at_a_time(ledger_url, monkeypatch):
    """Code path only (the bulk statement is made to raise): the sweep resumes every entry
    one at a time instead, and counts no error."""
    from test_recovery import RecordingApp

    store = LedgerStore(ledger_url)
    try:
        make_interrupted(store, 4)

        def broken(*_: Any, **__: Any) -> Any:
            raise RuntimeError("a bug in the bulk statement")

        monkeypatch.setattr(store, "begin_resume_many", broken)
        app = RecordingApp()
        report = run_sweep(store, app, lease_seconds=60, max_resumes=5, retention_days=7)
        assert (report.resumed, report.errors) == (4, 0)
        assert sorted(app.sent) == [f"tid-{i}" for i in range(4)]
    finally:
        store.dispose()


def test_a_batched_sweep_on_rabbitmq_confirms_every_re_send_to_one_queue(rabbitmq, sqlite_url):
    """RabbitMQ: no pipeline, one publish confirmed at a time over the one confirming
    connection; the queue is declared by the first send of the batch only, and every later
    send still lands in it."""
    from kombu import Connection

    from celery_ledger import create_app
    from celery_ledger.recovery import publish

    app = create_app("sweeper", broker_url=rabbitmq, ledger_url=sqlite_url)
    store = LedgerStore(sqlite_url)
    try:
        make_interrupted(store, 7, queue="batch-amqp")
        report = run_sweep(store, app, lease_seconds=60, max_resumes=5, retention_days=7)
        assert (report.found, report.resumed, report.errors) == (7, 7, 0)
        with Connection(rabbitmq) as conn:
            channel = conn.channel()
            try:
                depth = int(channel.queue_declare("batch-amqp", passive=True).message_count)
            finally:
                channel.close()
        assert depth == 7
    finally:
        publish.close(app)
        app.close()
        store.dispose()
