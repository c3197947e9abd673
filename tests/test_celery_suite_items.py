"""guarantees.md § "Bad input", items 21-23: what Celery's own integration tests found, each through
a real ``celery worker`` over Redis with a PostgreSQL ledger.

The whole of Celery's suite, plain and ledgered, is run by ``.ci/celery-suite`` (too long for
the README's test command); docs/celery-suite.md lists the tests that differ and why.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from celery_ledger import LedgerTask, create_app
from celery_ledger.codec import decode
from celery_ledger.ledger import EntryStatus, LedgerStore
from celery_ledger.recovery import run_sweep
from helpers import effect_counts, event_names, key_of
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes


@pytest.mark.parametrize("via_chain", [False, True], ids=["same-task", "chain-ending-in-it"])
def test_replace_with_the_same_task_runs_each_replacement_once(tmp_path, redis, pg_url, via_chain):
    """``self.replace()`` with the same task, or with a chain ending in it (Celery's nesting
    tests): the replacement inherits the task id with other arguments. The ledger refused it
    as ``KeyConflict``; each replacement is a new call and runs, once."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    tag = f"rp-{'chain' if via_chain else 'self'}"
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=2)
        result = app.send_task("tests_app.replace_self", args=(tag, 2, via_chain))
        assert result.get(timeout=60) == f"done:{tag}"
    bodies = effect_counts(pg_url, tag)
    assert bodies == {(tag, "body-2"): 1, (tag, "body-1"): 1, (tag, "body-0"): 1}, bodies
    store = LedgerStore(pg_url)
    replaced = store.get_entry(key_of("tests_app.replace_self", result.id))
    assert replaced.status is EntryStatus.FAILED and "replaced by" in (replaced.reason or "")
    if via_chain:  # the chains' heads ran too, once each
        heads = effect_counts(pg_url, f"{tag}-head-2") | effect_counts(pg_url, f"{tag}-head-1")
        assert sorted(heads.values()) == [1, 1], heads


@pytest.mark.parametrize("kind", ["async", "group"])
def test_a_returned_result_object_is_stored_as_celery_stores_it(tmp_path, redis, pg_url, kind):
    """A body that returns an ``AsyncResult`` or a ``GroupResult`` failed with
    ``PayloadNotSerializable``: the ledger encoded the raw value, before Celery's own
    conversion (``backend.prepare_value``: the result's ``as_tuple()``). The entry stores, and
    the caller gets, what plain Celery gives."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    tag = f"rr-{kind}"
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        result = app.send_task("tests_app.returns_result", args=(tag, kind))
        got = result.get(timeout=60)
    one = [[f"{tag}-one", None], None]
    expected = one if kind == "async" else [[f"{tag}-group", None], [one]]
    assert got == expected
    entry = LedgerStore(pg_url).get_entry(key_of("tests_app.returns_result", result.id))
    assert entry.status is EntryStatus.COMPLETED, entry.error
    assert json.loads(json.dumps(decode(entry.result))) == expected
    assert effect_counts(pg_url, tag) == {(tag, "body"): 1}


def test_a_purge_ends_no_entry_and_a_revoke_before_it_does(tmp_path, redis, pg_url):
    """``control.purge()`` removes messages but cannot say which: their publish intents stay,
    and the sweep re-sends them (documented, docs/operations.md "Purging a queue"). The
    operator's way to drop a task for good is a revoke (recorded in the ledger: its entry is
    cancelled) or ``celery-ledger cancel``; that task never runs."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    producer = create_app(
        "producer23",
        broker_url=redis,
        result_backend=redis,
        ledger_url=pg_url,
        data_dir=tmp_path / "producer",
        ledger_publish_intent=True,
        ledger_publish_intent_seconds=0.5,
        task_default_queue=env["TEST_QUEUE"],
    )

    @producer.task(base=LedgerTask, bind=True, name="tests_app.slow_effect", shared=False)
    def slow_effect(self: Any, tag: str, seconds: float) -> str:
        raise AssertionError("the producer never runs the body")

    kept = slow_effect.apply_async(("pg-kept", 0.0))
    dropped = slow_effect.apply_async(("pg-dropped", 0.0))
    assert producer.control.purge() == 2
    producer.control.revoke(dropped.id)
    store = LedgerStore(pg_url)
    keys = {t.id: key_of("tests_app.slow_effect", t.id) for t in (kept, dropped)}
    assert store.get_entry(keys[dropped.id]).status is EntryStatus.CANCELLED
    wait_for(
        lambda: (store.peek_status(keys[kept.id]) or (None, 1.0))[1] <= 0,
        timeout=10,
        what="the kept intent's lease to pass",
    )
    report = run_sweep(store, producer, lease_seconds=60, max_resumes=5, retention_days=7)
    assert keys[kept.id] in report.resumed_keys, report  # the purged message, sent again
    assert keys[dropped.id] not in report.resumed_keys, report
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        wait_for(
            lambda: store.get_entry(keys[kept.id]).status is EntryStatus.COMPLETED,
            timeout=60,
            what="the purged task the sweep re-sent to complete",
        )
    assert effect_counts(pg_url, "pg-kept") == {("pg-kept", "body"): 1}
    assert effect_counts(pg_url, "pg-dropped") == {}, event_names(store, keys[dropped.id])
