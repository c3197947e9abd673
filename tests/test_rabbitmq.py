"""RabbitMQ as a first-class broker (design.md § "Recovery"): confirmed re-sends, quorum queues, the
dead-lettered poison message, and the worker's basics on ``amqp://``.

Every test gets a vhost of its own (``rabbitmq`` fixture), so parallel runs never share a queue,
and deleting the vhost removes everything the test declared.
"""

from __future__ import annotations

import json
import time

import pytest
from celery import Celery
from kombu import Connection

from celery_ledger import create_app
from celery_ledger.ledger import (
    RESUME_OWNER,
    ClaimRequest,
    EntryNotFound,
    EntryStatus,
    LedgerStore,
    Owner,
)
from celery_ledger.recovery import publish, run_sweep
from helpers import configure_queue, effect_counts, event_names, key_of
from procs import processes, test_env, wait_for
from servers import rabbitmqctl

pytestmark = [pytest.mark.rabbitmq]


def interrupted_entry(store: LedgerStore, key: str, queue: str) -> None:
    """An entry a dead worker left running, with a snapshot that re-sends it to ``queue``."""
    store.claim(
        ClaimRequest(
            key=key,
            task_name="tests_app.plain_add",
            task_id=f"tid-{key}",
            args_hash="task-id",
            snapshot=json.dumps({"args": [1, 2], "kwargs": {}, "queue": queue}),
            side_effect="non_idempotent",
            owner=Owner("celery@gone", "boot-0", 1),
            lease_seconds=0.01,
            max_interruptions=5,
        )
    )
    time.sleep(0.05)


def full_queue(url: str, name: str) -> None:
    """A queue that refuses every publish: a policy (not queue arguments, which Celery's own
    declaration would contradict) caps it at length 0 with ``reject-publish``, so RabbitMQ
    nacks a publish when the publisher asks for confirms, and drops it silently otherwise."""
    vhost = url.rsplit("/", 1)[1]
    rabbitmqctl(
        "set_policy",
        "-p",
        vhost,
        "refuse",
        f"^{name}$",
        '{"max-length": 0, "overflow": "reject-publish"}',
        "--apply-to",
        "queues",
    )
    with Connection(url) as conn:
        channel = conn.channel()
        channel.queue_declare(name, durable=True, auto_delete=False)
        channel.close()


def queue_depth(url: str, name: str) -> int:
    with Connection(url) as conn:
        channel = conn.channel()
        try:
            return int(channel.queue_declare(name, passive=True).message_count)
        finally:
            channel.close()


def test_a_resume_the_broker_refused_is_not_counted_as_sent(rabbitmq, sqlite_url):
    """The sweep publishes with confirms: a re-send RabbitMQ nacks is reported lost-race (not
    resumed), and the entry's resume lease brings it back to the next sweep."""
    app = create_app("sweeper", broker_url=rabbitmq, ledger_url=sqlite_url)
    store = LedgerStore(sqlite_url)
    full_queue(rabbitmq, "refusing")
    interrupted_entry(store, "k-refused", "refusing")
    try:
        report = run_sweep(store, app, lease_seconds=30, max_resumes=5, retention_days=7)
    finally:
        publish.close(app)
        app.close()
    assert report.interrupted == 1 and report.found == 1
    assert report.resumed == 0, report
    entry = store.get_entry("k-refused")
    assert entry.status is EntryStatus.RUNNING and entry.owner == RESUME_OWNER
    assert queue_depth(rabbitmq, "refusing") == 0


def amqp_client(env: dict[str, str]) -> Celery:
    """A producer with the workers' broker, results and queue declaration."""
    app = Celery("client", broker=env["CELERY_BROKER_URL"], backend=env["CELERY_RESULT_BACKEND"])
    app.conf.task_default_queue = env["TEST_QUEUE"]
    configure_queue(app, env)
    return app


@pytest.mark.processes
@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_second_delivery_waits_then_returns_on_amqp(tmp_path, rabbitmq, pg_url, queue_type):
    """The same task id delivered twice while it runs: the copy meets WAIT, re-queues itself
    with a countdown (a confirmed publish; native delayed delivery on the quorum queue), and
    returns the stored result once the first run ends. The body runs once."""
    env = test_env(
        tmp_path,
        broker=rabbitmq,
        ledger_url=pg_url,
        TEST_QUEUE_TYPE=queue_type,
        # the copy re-queues itself every second (not for the lease's remaining 60 s)
        CELERY_LEDGER_WAIT_COUNTDOWN_MAX=1,
    )
    client = amqp_client(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=2)
        first = client.send_task("tests_app.slow_effect", args=("amqp-wait", 4.0))
        key = key_of("tests_app.slow_effect", first.id)
        wait_for(lambda: "claimed" in event_names(store, key), timeout=30, what="the claim")
        client.send_task("tests_app.slow_effect", args=("amqp-wait", 4.0), task_id=first.id)
        wait_for(lambda: "waited" in event_names(store, key), timeout=30, what="the WAIT")
        wait_for(lambda: "returned" in event_names(store, key), timeout=90, what="RETURN")
        assert first.get(timeout=30) == "done:amqp-wait"
    assert effect_counts(pg_url, "amqp-wait") == {("amqp-wait", "body"): 1}
    assert store.get_entry(key).status is EntryStatus.COMPLETED
    client.close()


@pytest.mark.processes
def test_a_poison_message_dead_lettered_by_a_quorum_queue_is_still_accounted_for(
    tmp_path, rabbitmq, pg_url
):
    """A task that kills its pool process on every run, on a quorum queue with
    ``x-delivery-limit: 1``: RabbitMQ dead-letters the message after its second delivery. The
    ledger does not need it: each lost run left the entry ``interrupted`` (the worker-lost
    fast path), the sweep re-sends it from its snapshot (a new message, a fresh delivery
    count), and the ledger's crash-loop rule parks it ``blocked`` with its reason."""
    env = test_env(
        tmp_path,
        broker=rabbitmq,
        ledger_url=pg_url,
        TEST_QUEUE_TYPE="quorum",
        TEST_DELIVERY_LIMIT="1",
        CELERY_LEDGER_MAX_RESUMES="3",
        CELERY_LEDGER_LEASE_SECONDS="3",
        CELERY_LEDGER_SWEEP_INTERVAL="1",
    )
    client = amqp_client(env)
    dead = f"{env['TEST_QUEUE']}.dead"
    with Connection(rabbitmq) as conn:
        channel = conn.channel()
        channel.queue_declare(dead, durable=True, auto_delete=False)
        channel.close()
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=["--max-tasks-per-child", "100"])
        procs.beat()
        result = client.send_task("tests_app.crash_always", args=("poison",))
        key = key_of("tests_app.crash_always", result.id)

        def parked() -> bool:
            try:
                return store.get_entry(key).status is EntryStatus.BLOCKED
            except EntryNotFound:
                return False

        wait_for(parked, timeout=150, interval=0.5, what="the crash loop to be parked")
    entry = store.get_entry(key)
    assert entry.reason and "crash loop" in entry.reason, entry.reason
    # The broker did dead-letter copies on the way: the ledger, not the broker, decided.
    assert queue_depth(rabbitmq, dead) >= 1
    events = event_names(store, key)
    assert "resuming" in events, events
    client.close()


@pytest.mark.processes
def test_flower_counts_the_ledgers_events_on_amqp(tmp_path, rabbitmq, pg_url):
    """Flower on RabbitMQ: the worker's task-ledger-* events reach it over amqp:// and show in
    its /metrics, next to the ledger's own gauges."""
    from test_flower import FlowerClient, events_total, free_port, ledger_gauge, start_flower

    env = test_env(tmp_path, broker=rabbitmq, ledger_url=pg_url, CELERY_LEDGER_METRICS_TTL=1)
    client = amqp_client(env)
    port = free_port()
    flower = FlowerClient(port)
    sent: list[str] = []
    with processes(tmp_path, env) as procs:
        start_flower(procs, port)
        procs.worker(extra=["-E"])

        def counted() -> bool:
            # Flower subscribes to events asynchronously: send until one is counted.
            sent.append(client.send_task("tests_app.slow_effect", args=("fl", 0.0)).id)
            metrics = flower.metrics()
            return events_total(metrics, "task-ledger-claimed", "tests_app.slow_effect") >= 1

        wait_for(counted, timeout=90, interval=2.0, what="a task-ledger-claimed event in Flower")
        assert ledger_gauge(flower.metrics(), "up") == 1
    client.close()
