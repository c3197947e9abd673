"""Bad input gets a clear error and loses nothing (guarantees.md § "Bad input")."""

from __future__ import annotations

import pytest
from celery import Celery
from kombu.exceptions import EncodeError

from celery_ledger import LedgerTask
from celery_ledger.ledger import EntryStatus, LedgerStore, StepStatus
from helpers import effect_counts, key_of
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes


def test_unserializable_arguments_are_refused_at_send(tmp_path):
    env = test_env(tmp_path, broker=None, ledger_url=f"sqlite:///{tmp_path / 'l.sqlite3'}")
    app = client_app(env)
    with pytest.raises(EncodeError, match="not JSON serializable"):
        app.send_task("tests_app.order", args=(object(), 1))


def test_key_from_naming_a_missing_argument_fails_at_registration():
    app = Celery("reg", broker="memory://", set_as_current=False)

    def charge(order_id: str, amount: int) -> None:
        return None

    app.task(base=LedgerTask, name="reg.charge", key_from=("order",), shared=False)(charge)
    with pytest.raises(ValueError, match=r"key_from names \['order'\].*charge\(order_id, amount\)"):
        app.finalize(auto=True)
        app.tasks["reg.charge"]


def test_bad_side_effect_class_fails_at_registration():
    app = Celery("reg2", broker="memory://", set_as_current=False)

    def t() -> None:
        return None

    app.task(base=LedgerTask, name="reg2.t", side_effect="sometimes", shared=False)(t)
    with pytest.raises(ValueError, match="side_effect='sometimes'"):
        app.finalize(auto=True)
        app.tasks["reg2.t"]


def test_oversized_result_is_a_clear_failure_and_never_reruns(tmp_path):
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger, CELERY_LEDGER_MAX_RESULT_BYTES="1000")
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        first = app.send_task("tests_app.big_result", args=(5000,))
        with pytest.raises(Exception, match="over the limit of 1000 bytes") as info:
            first.get(timeout=60)
        assert type(info.value).__name__ == "PayloadTooLarge"
        again = app.send_task("tests_app.big_result", args=(5000,), task_id=first.id)
        with pytest.raises(Exception, match="over the limit"):
            again.get(timeout=60)
    store = LedgerStore(ledger)
    assert store.get_entry(key_of("tests_app.big_result", first.id)).status is EntryStatus.FAILED
    assert effect_counts(ledger, "big") == {("big", "body"): 1}


def test_unserializable_step_output_leaves_the_step_ambiguous(tmp_path):
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        result = app.send_task("tests_app.unserializable_output", args=("u1",))
        with pytest.raises(Exception, match="cannot be stored as JSON") as info:
            result.get(timeout=60)
        assert type(info.value).__name__ == "PayloadNotSerializable"
    store = LedgerStore(ledger)
    key = key_of("tests_app.unserializable_output", result.id)
    entry = store.get_entry(key)
    # The step returned: the reason says so, and that it executed (guarantees.md § "Bad input",
    # item 19).
    assert entry.status is EntryStatus.BLOCKED
    assert "'make' returned, and only its output could not be stored" in entry.reason
    assert "it executed" in entry.reason and "may have executed" not in entry.reason
    assert [s.status for s in store.load_steps(key)] == [StepStatus.STARTED]


def test_ledger_unreachable_at_settle_leaves_entry_for_recovery(tmp_path, redis, pg_url):
    """The ledger goes away while the body runs: settle retries within its bound, then leaves
    the entry running; the lease expires, beat's sweep resumes it, steps replay, and the task
    completes with every effect exactly once."""
    from celery_ledger.harness.tcpproxy import TcpProxy

    LedgerStore(pg_url).ensure_ready()  # schema, while reachable
    pg_port = int(pg_url.split("@", 1)[1].split("/", 1)[0].split(":")[1])
    proxy = TcpProxy("127.0.0.1", pg_port).start()
    port = proxy.port
    proxied = f"postgresql://postgres@127.0.0.1:{port}/{pg_url.rsplit('/', 1)[1]}"
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=proxied,
        TEST_EFFECTS_URL=pg_url,
        CELERY_LEDGER_SETTLE_RETRY_SECONDS="1",
        CELERY_LEDGER_LEASE_SECONDS="3",
        CELERY_LEDGER_SWEEP_INTERVAL="1",
    )
    app = client_app(env)
    try:
        with processes(tmp_path, env) as procs:
            worker = procs.worker("w1", concurrency=1)
            result = app.send_task("tests_app.steps_then_wait", args=("st1", 3.0))
            wait_for(
                lambda: effect_counts(pg_url, "st1").get(("st1", "b")),
                timeout=30,
                what="both steps to complete",
            )
            proxy.stop()  # the ledger is gone before the settle
            worker.wait_log("entry left running for recovery", timeout=30)
            proxy = TcpProxy("127.0.0.1", pg_port, port=port).start()
            procs.beat()
            assert result.get(timeout=90) == ["a:st1", "b:st1"]
            key = key_of("tests_app.steps_then_wait", result.id)
            store = LedgerStore(pg_url)
            wait_for(
                lambda: store.get_entry(key).status is EntryStatus.COMPLETED,
                timeout=60,
                what="the resumed attempt to settle",
            )
    finally:
        proxy.stop()
    assert effect_counts(pg_url, "st1") == {("st1", "a"): 1, ("st1", "b"): 1}
    assert [e.event for e in store.entry_events(key)].count("resuming") >= 1
