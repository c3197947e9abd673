"""Transaction steps and the transactional outbox under real workers (design.md § "Transaction
steps and the transactional outbox").

Broker: Redis. The application's table is ``test_effects`` (no unique constraint) in the
ledger's own database, so a duplicate write is a count of 2. ``tests_app.transfer`` runs two
transaction steps (``credit`` with Core, ``debit`` with an ORM session); ``tests_app.fanout``
sends two children from a plain step (``notify``) and one from a transaction step (``book``).
Crash points fire once (``CELERY_LEDGER_CRASH_ONCE``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from test_broker_faults import OwnRedis
from test_steps_crash import run_with_crash

from celery_ledger.ledger import (
    EntryNotFound,
    EntryStatus,
    LedgerStore,
    StepStatus,
    child_task_id,
)
from helpers import business_key, effect_counts, event_names, key_of
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

TRANSFER = {("t1", "credit"): 1, ("t1", "debit"): 1}


def marker(tmp_path: Path, point: str) -> Path:
    return Path(f"{tmp_path / 'crash-once'}.{point.replace(':', '_')}")


def settled_once(url: str, task: str, **key: str) -> LedgerStore:
    store = LedgerStore(url)
    entry = store.get_entry(business_key(task, **key))
    assert entry.status is EntryStatus.COMPLETED, entry
    assert store.stats().duplicate_executions == 0
    return store


# -- (1) SIGKILL inside a transaction step, before and right after its commit ----------------


@pytest.mark.parametrize(
    "crash_at",
    [
        "txn-written:credit",  # Core: written, not committed
        "step-completed:credit",  # Core: committed with its row
        "txn-written:debit",  # ORM session: flushed, not committed
    ],
)
def test_sigkill_in_a_transaction_step_writes_exactly_once(tmp_path, redis, ledger_url, crash_at):
    value, _ = run_with_crash(tmp_path, redis, ledger_url, crash_at, "tests_app.transfer", ("t1",))
    assert value == ["credit:t1", "debit:t1"]
    assert effect_counts(ledger_url, "t1") == TRANSFER
    store = settled_once(ledger_url, "tests_app.transfer", tag="t1")
    key = business_key("tests_app.transfer", tag="t1")
    entry = store.get_entry(key)
    assert entry.executions == 2 and "interrupted" in event_names(store, key)
    assert "blocked" not in event_names(store, key)


# -- (2) SIGSTOP past the lease inside a transaction step ------------------------------------


def test_paused_transaction_step_is_fenced_out_and_rolled_back(tmp_path, redis, pg_url):
    """The zombie stops with its write made and not committed; the lease runs out, another
    worker takes over and commits; after SIGCONT the zombie's commit is refused and its
    write rolled back."""
    point = "txn-written:credit"
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_LEASE_SECONDS="2",
        CELERY_LEDGER_SWEEP_INTERVAL="1",
        CELERY_LEDGER_CRASH_AT=f"{point}@stop",
        CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-once"),
    )
    app = client_app(env)
    stopped = marker(tmp_path, point)
    with processes(tmp_path, env) as procs:
        zombie = procs.worker("zombie", concurrency=1)
        result = app.send_task("tests_app.transfer", args=("t1",))
        wait_for(
            lambda: stopped.exists() and stopped.read_text().strip() != "",
            timeout=60,
            what="the transaction step paused with its write made",
        )
        zombie.pause()  # the worker's parent too, so it prefetches nothing meanwhile
        try:
            procs.worker("w2", concurrency=1)
            procs.beat()
            value = result.get(timeout=90)
        finally:
            zombie.resume()
        zombie.wait_log("superseded", timeout=30)
        zombie.terminate()
        zombie.proc.wait(timeout=60)
    assert value == ["credit:t1", "debit:t1"]
    assert effect_counts(pg_url, "t1") == TRANSFER
    store = settled_once(pg_url, "tests_app.transfer", tag="t1")
    assert store.get_entry(business_key("tests_app.transfer", tag="t1")).fence >= 3


# -- (3) SIGKILL between the step's commit and the children's publish, and after it ----------


def child_ids(parent_key: str) -> list[str]:
    return [
        child_task_id(parent_key, "notify", 0, 0),
        child_task_id(parent_key, "notify", 0, 1),
        child_task_id(parent_key, "book", 0, 0),
    ]


def children_done(store: LedgerStore, ids: list[str]) -> bool:
    for cid in ids:
        try:
            entry = store.get_entry(key_of("tests_app.child_effect", cid))
        except EntryNotFound:
            return False
        if entry.status is not EntryStatus.COMPLETED:
            return False
    return store.count_unpublished() == 0


@pytest.mark.parametrize(
    "crash_at",
    [
        "step-completed:notify",  # plain step: recorded, not published
        "children-published:notify",  # published, not marked: the sweep publishes again
        "step-completed:book",  # transaction step: recorded, not published
        "children-published:book",
    ],
)
def test_each_child_runs_exactly_once(tmp_path, redis, pg_url, crash_at):
    run_fanout(tmp_path, redis, pg_url, crash_at)


@pytest.mark.rabbitmq
@pytest.mark.parametrize("crash_at", ["step-completed:notify", "children-published:book"])
def test_each_child_runs_exactly_once_on_rabbitmq(tmp_path, rabbitmq, pg_url, crash_at):
    """The same on RabbitMQ, where the publish of the children waits for the broker's
    confirms (``recovery.publish.confirmed``)."""
    run_fanout(tmp_path, rabbitmq, pg_url, crash_at)


def run_fanout(tmp_path, broker, pg_url, crash_at):
    env = test_env(
        tmp_path,
        broker=broker,
        ledger_url=pg_url,
        CELERY_LEDGER_SWEEP_INTERVAL="1",
        CELERY_LEDGER_CRASH_AT=crash_at,
        CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-once"),
    )
    app = client_app(env)
    parent = business_key("tests_app.fanout", tag="f1")
    ids = child_ids(parent)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=2)
        procs.beat()
        try:
            value = app.send_task("tests_app.fanout", args=("f1",)).get(timeout=90)
        finally:
            app.close()  # its broker connection (RabbitMQ's socket) is closed here
        store = LedgerStore(pg_url)
        wait_for(lambda: children_done(store, ids), timeout=90, what="every child ran")
        if crash_at.startswith("children-published"):
            # The sweep's second publish arrived and the child's claim returned it.
            again = [c for c in ids if _sent_by(crash_at, store, c)]
            assert again
            wait_for(
                lambda: all(
                    "returned" in event_names(store, key_of("tests_app.child_effect", c))
                    for c in again
                ),
                timeout=60,
                what="the re-published children deduplicated by their claims",
            )
    assert marker(tmp_path, crash_at).exists(), f"the crash point {crash_at} was never reached"
    assert value == ids
    assert effect_counts(pg_url, "f1") == {
        ("f1", "book"): 1,
        ("f1", "child-0"): 1,
        ("f1", "child-1"): 1,
        ("f1", "child-2"): 1,
    }
    store = settled_once(pg_url, "tests_app.fanout", tag="f1")
    listed = store.children_of(parent)
    assert [m.child_id for m in listed] == ids and all(m.published for m in listed)
    assert store.parent_of(ids[0]).parent_key == parent


def _sent_by(crash_at: str, store: LedgerStore, child_id: str) -> bool:
    """Whether ``child_id`` was sent by the step the crash point interrupted."""
    step = crash_at.split(":", 1)[1]
    found = store.parent_of(child_id)
    return found is not None and found.step == step


# -- (4) the broker is down when the children are published ----------------------------------


def test_children_published_while_the_broker_is_down_go_out_through_the_sweep(tmp_path, pg_url):
    """The step commits, the broker goes away, the publish fails: the children stay recorded;
    once the broker is back, the sweep publishes them and each runs once."""
    own = OwnRedis(tmp_path)
    own.start()
    point = "step-completed:notify"
    try:
        env = test_env(
            tmp_path,
            broker=own.url,
            ledger_url=pg_url,
            # Results in SQLite, so that the broker going away costs the test nothing else.
            CELERY_RESULT_BACKEND=f"db+sqlite:///{tmp_path / 'results.sqlite3'}",
            CELERY_LEDGER_SWEEP_INTERVAL="1",
            CELERY_LEDGER_LEASE_SECONDS="60",
            CELERY_LEDGER_CRASH_AT=f"{point}@stop",
            CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-once"),
        )
        app = client_app(env)
        parent = business_key("tests_app.fanout", tag="f1")
        ids = child_ids(parent)
        stopped = marker(tmp_path, point)
        store = LedgerStore(pg_url)
        with processes(tmp_path, env) as procs:
            w1 = procs.worker("w1", concurrency=1)
            app.send_task("tests_app.fanout", args=("f1",))
            wait_for(
                lambda: stopped.exists() and stopped.read_text().strip() != "",
                timeout=60,
                what="the step paused after its commit",
            )
            assert len(store.unpublished(older_than=0.0)) == 2  # recorded with the step's row
            own.stop()
            os.kill(int(stopped.read_text()), signal.SIGCONT)
            w1.wait_log("wait for the sweep", timeout=60)
            own.start()  # empty: nothing the broker held before survives
            # Seen with kombu 5.x: a worker whose Redis restarted may not consume again; a
            # new worker, as a supervisor would start (tests/test_broker_faults.py).
            w1.stop(timeout=10)
            procs.worker("w2", concurrency=2)
            procs.beat()
            wait_for(lambda: children_done(store, ids), timeout=90, what="the children ran")
    finally:
        own.stop()
    assert effect_counts(pg_url, "f1") == {
        ("f1", "book"): 1,
        ("f1", "child-0"): 1,
        ("f1", "child-1"): 1,
        ("f1", "child-2"): 1,
    }
    assert all(m.published for m in store.children_of(parent))


# -- (5) the children of an ambiguous effect step ride its reconciler's verdict ---------------


@pytest.mark.parametrize(
    "crash_at",
    [
        # The step sent its child and charged; killed before its completed row.
        "step-returned:charge",
        # The same, then the attempt that recorded the verdict is killed after publishing the
        # child and before marking it: the sweep publishes it again, and its claim returns.
        "step-returned:charge,children-published:charge",
    ],
)
def test_the_children_of_an_ambiguous_step_ride_its_reconciled_verdict(
    tmp_path, redis, pg_url, crash_at
):
    """``tests_app.charge_and_notify``: an effect step sends a child through the outbox and
    charges, and its process dies before the step's ``completed`` row (so nothing recorded
    the child). The takeover's reconciler finds the charge and answers
    ``completed(output, children=[...])``: the child is recorded with the verdict, under the
    id the step would have used, published, and runs exactly once."""
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_SWEEP_INTERVAL="1",
        CELERY_LEDGER_CRASH_AT=crash_at,
        CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-once"),
    )
    app = client_app(env)
    parent = business_key("tests_app.charge_and_notify", tag="n1")
    cid = child_task_id(parent, "charge", 0, 0)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        procs.beat()
        result = app.send_task("tests_app.charge_and_notify", args=("n1",))
        # The child first: before the fix the parent settles blocked or completed, and the
        # child it sent is never run.
        wait_for(
            lambda: children_done(store, [cid]),
            timeout=60,
            what="the child the reconciler returned ran",
        )
        value = result.get(timeout=60)
        if "children-published" in crash_at:
            wait_for(
                lambda: "returned" in event_names(store, key_of("tests_app.child_effect", cid)),
                timeout=60,
                what="the re-published child deduplicated by its claim",
            )
    for point in crash_at.split(","):
        assert marker(tmp_path, point).exists(), f"the crash point {point} was never reached"
    assert value == "charge:n1"
    assert effect_counts(pg_url, "n1") == {("n1", "charge"): 1, ("n1", "child-0"): 1}
    store = settled_once(pg_url, "tests_app.charge_and_notify", tag="n1")
    # The step ran once: its row was completed by the verdict of a later fence, not re-run.
    (row,) = store.load_steps(parent)
    assert (row.name, row.status, row.fence > 1) == ("charge", StepStatus.COMPLETED, True)
    listed = store.children_of(parent)
    assert [(m.child_id, m.step, m.published) for m in listed] == [(cid, "charge", True)]
    assert store.parent_of(cid).parent_key == parent
