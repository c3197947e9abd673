"""guarantees.md § "Bad input", items 20 and 12: Celery's ``Reject`` in a ledgered body, and a
business key whose argument a call does not give.

The delivery tests start real ``celery worker`` processes over Redis with a PostgreSQL ledger.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from celery.signals import before_task_publish

from celery_ledger import LedgerTask, create_app
from celery_ledger.ledger import EntryStatus, IdentityError, LedgerStore
from helpers import business_key, effect_counts, event_names, key_of
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes


def _settled(store: LedgerStore, key: str) -> bool:
    found = store.peek_status(key)
    return found is not None and found[0].settled


def test_reject_requeue_runs_the_body_again_on_redelivery(tmp_path, redis, pg_url):
    """``Reject(requeue=True)`` puts the message back on the queue: the entry must not settle
    ``failed`` (every redelivery then RETURNed and raised the stored Reject again, a loop of
    1,068 deliveries whose body never ran a second time). The redelivery runs the body."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        result = app.send_task("tests_app.reject_once", args=("rej-1",))
        key = key_of("tests_app.reject_once", result.id)
        wait_for(lambda: _settled(store, key), timeout=60, what="the entry to settle")
        entry = store.get_entry(key)
        names = event_names(store, key)
        assert entry.status is EntryStatus.COMPLETED, (
            f"entry {entry.status.value} ({entry.reason or entry.error}); events {names}"
        )
        assert result.get(timeout=30) == "done:rej-1"
    assert effect_counts(pg_url, "rej-1") == {("rej-1", "body"): 2}
    assert names.count("returned") <= 1, f"a redelivery loop: {names}"


def test_reject_without_requeue_ends_the_entry_with_its_reason(tmp_path, redis, pg_url):
    """``Reject(requeue=False)`` drops (dead-letters) the message: the entry ends ``failed``
    with a reason that says so, and the body ran once."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    store = LedgerStore(pg_url)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        result = app.send_task("tests_app.reject_once", args=("rej-2",), kwargs={"requeue": False})
        key = key_of("tests_app.reject_once", result.id)
        wait_for(lambda: _settled(store, key), timeout=60, what="the entry to settle")
        # A good task after it completes: the worker went on consuming.
        after = app.send_task("tests_app.slow_effect", args=("rej-2-after", 0.0))
        assert after.get(timeout=60) == "done:rej-2-after"
    entry = store.get_entry(key)
    assert entry.status is EntryStatus.FAILED
    assert "rejected" in (entry.reason or ""), entry.reason
    assert effect_counts(pg_url, "rej-2") == {("rej-2", "body"): 1}


def test_missing_key_argument_fails_the_delivery_and_the_worker_goes_on(tmp_path, redis, pg_url):
    """``key_from=("order_id",)`` on a ``**kwargs`` task: a message without ``order_id`` got the
    key material ``{"order_id": None}``, shared by every such call (the second got KeyConflict,
    a third the first's result). It must fail with a reason naming the argument, run nothing,
    and be acked; a following good task completes."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        for tag in ("mk-1", "mk-2"):
            bad = app.send_task("tests_app.kw_order", kwargs={"tag": tag})
            with pytest.raises(Exception, match="order_id") as info:
                bad.get(timeout=60)
            assert isinstance(info.value, IdentityError), repr(info.value)
            assert "\n" not in str(info.value), str(info.value)
        good = app.send_task("tests_app.kw_order", kwargs={"tag": "mk-3", "order_id": "o-3"})
        assert good.get(timeout=60) == {"tag": "mk-3", "order_id": "o-3"}
    assert effect_counts(pg_url, "mk-1") == {}
    assert effect_counts(pg_url, "mk-2") == {}
    store = LedgerStore(pg_url)
    assert store.peek_status(business_key("tests_app.kw_order", order_id=None)) is None
    assert "claimed" in event_names(store, business_key("tests_app.kw_order", order_id="o-3"))


def test_missing_key_argument_is_refused_at_publish(tmp_path):
    """With publish intents, ``apply_async`` without the key argument raises before anything is
    published or recorded."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    producer = create_app(
        "producer30",
        data_dir=tmp_path / "data",
        broker_url="memory://",
        ledger_url=ledger,
        ledger_publish_intent=True,
    )

    @producer.task(
        base=LedgerTask, bind=True, name="kw30.order", shared=False, key_from=("order_id",)
    )
    def order(self: Any, tag: str, **kwargs: Any) -> None:
        raise AssertionError("the producer never runs the body")

    published: list[Any] = []

    def seen(sender: Any = None, headers: Any = None, **_: Any) -> None:
        published.append((sender, (headers or {}).get("id")))

    before_task_publish.connect(seen, weak=False)
    try:
        with pytest.raises(IdentityError, match="order_id") as info:
            order.apply_async(kwargs={"tag": "p-1"}, task_id="p-1")
        assert "\n" not in str(info.value)
        assert published == [], published
        order.apply_async(kwargs={"tag": "p-2", "order_id": "o-2"}, task_id="p-2")
        assert [tid for _, tid in published] == ["p-2"]
    finally:
        before_task_publish.disconnect(seen)
    store = LedgerStore(ledger)
    assert store.peek_status(business_key("kw30.order", order_id=None)) is None
    assert store.peek_status(business_key("kw30.order", order_id="o-2")) is not None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
