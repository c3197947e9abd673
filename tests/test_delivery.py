"""Delivery semantics with real workers: duplicates, business keys, conflicts (contract.md § "The
claim and its gates").

Every test here starts real ``celery worker`` processes over a real broker and database.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from celery import Celery

from celery_ledger.ledger import EntryStatus, LedgerStore
from helpers import business_key, effect_counts, event_names, key_of
from procs import processes, redelivering, test_env, wait_for

pytestmark = pytest.mark.processes


def client_app(env: dict[str, str]) -> Celery:
    """A producer-side app with the same broker/backend as the workers."""
    app = Celery(
        "client",
        broker=env.get("CELERY_BROKER_URL", "filesystem://"),
        backend=env["CELERY_RESULT_BACKEND"],
    )
    app.conf.task_default_queue = env["TEST_QUEUE"]
    if "CELERY_BROKER_URL" not in env:
        folder = Path(env["CELERY_LEDGER_DATA_DIR"]) / "broker"
        data = Path(env["CELERY_LEDGER_DATA_DIR"])
        app.conf.broker_transport_options = {
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "control_folder": str(data / "broker-control"),
        }
    if env["CELERY_RESULT_BACKEND"].startswith("db+"):
        create_result_tables(app)
    return app


def create_result_tables(app: Celery) -> None:
    """Create the results database's tables now, through a SessionManager of their own.

    This process polls a new results database in each test, often before any worker has
    stored a result in it. Celery 5.4 creates those tables on a database result backend's
    first session, once per process (its default ``SessionManager``, shared by every backend,
    has one ``prepared`` flag), so the second test's reads failed with ``no such table:
    celery_taskmeta``. Celery 5.5 and later keep a flag per backend.
    """
    from celery.backends.database.session import SessionManager

    app.backend.ResultSession(session_manager=SessionManager()).close()


def test_same_task_id_redelivered_by_redis_runs_body_once(tmp_path, redis, pg_url):
    """Redis hands a long task to a second worker after its visibility timeout (celery #4400).

    The second delivery must WAIT instead of running beside the first; both end with the
    first's result.
    """
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url, TEST_VISIBILITY_TIMEOUT="2")
    app = client_app(env)
    app.conf.broker_transport_options = {"visibility_timeout": 2}
    with processes(tmp_path, env) as procs, redelivering(env):
        procs.worker("w1", concurrency=1)
        procs.worker("w2", concurrency=1)
        result = app.send_task("tests_app.slow_effect", args=("dup-1", 8.0))
        assert result.get(timeout=60) == "done:dup-1"
        key = key_of("tests_app.slow_effect", result.id)
        store = LedgerStore(pg_url)

        def redelivered() -> bool:
            return "waited" in event_names(store, key) or "returned" in event_names(store, key)

        # The redelivery is Redis's doing; give it a bounded time to show up in the ledger.
        wait_for(redelivered, timeout=30, what="a second delivery of the same task id")
        wait_for(
            lambda: "returned" in event_names(store, key),
            timeout=60,
            what="the duplicate delivery to return the stored result",
        )
    assert effect_counts(pg_url, "dup-1") == {("dup-1", "body"): 1}
    assert store.get_entry(key).status is EntryStatus.COMPLETED
    assert result.get(timeout=5) == "done:dup-1"


def test_business_key_two_task_ids_one_body(tmp_path):
    """Embedded default: filesystem broker, SQLite ledger. Two task ids, one business key."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=2)
        r1 = app.send_task("tests_app.order", args=("ord-7", 100), kwargs={"pause": 1.0})
        r2 = app.send_task("tests_app.order", args=("ord-7", 100), kwargs={"pause": 1.0})
        v1, v2 = r1.get(timeout=60), r2.get(timeout=60)
    assert r1.id != r2.id
    assert (
        v1
        == v2
        == {
            "order_id": "ord-7",
            "amount": 100,
            "steps": ["reserve:ord-7", "charge:ord-7", "receipt:ord-7"],
        }
    )
    assert effect_counts(ledger, "ord-7") == {
        ("ord-7", "reserve"): 1,
        ("ord-7", "charge"): 1,
        ("ord-7", "receipt"): 1,
    }
    store = LedgerStore(ledger)
    names = event_names(store, business_key("tests_app.order", order_id="ord-7"))
    assert names.count("claimed") == 1 and "returned" in names


def test_business_key_with_different_arguments_conflicts(tmp_path):
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        first = app.send_task("tests_app.order", args=("ord-9", 100))
        assert first.get(timeout=60)["amount"] == 100
        second = app.send_task("tests_app.order", args=("ord-9", 999))
        with pytest.raises(Exception, match="different arguments") as info:
            second.get(timeout=60)
        assert type(info.value).__name__ == "KeyConflict"
    # The second body never ran: still one of each effect.
    assert effect_counts(ledger, "ord-9") == {
        ("ord-9", "reserve"): 1,
        ("ord-9", "charge"): 1,
        ("ord-9", "receipt"): 1,
    }
    store = LedgerStore(ledger)
    assert "conflict" in event_names(store, business_key("tests_app.order", order_id="ord-9"))


def test_ledger_unreachable_at_claim_runs_nothing_then_completes_once(tmp_path, pg_url):
    """The ledger is down when the task arrives: the body does not run; it is redelivered
    with backoff and completes exactly once when the ledger is back."""
    from celery_ledger.harness.tcpproxy import TcpProxy

    LedgerStore(pg_url).ensure_ready()  # create the schema while the database is reachable
    host_port = pg_url.split("@", 1)[1].split("/", 1)[0]
    dbname = pg_url.rsplit("/", 1)[1]
    proxy = TcpProxy("127.0.0.1", int(host_port.split(":")[1]))
    proxy.start()
    port = proxy.port
    proxy.stop()  # the ledger is "down": nothing listens on its port
    proxied = f"postgresql://postgres@127.0.0.1:{port}/{dbname}"
    env = test_env(
        tmp_path,
        broker=None,
        ledger_url=proxied,
        TEST_EFFECTS_URL=pg_url,
        CELERY_LEDGER_UNAVAILABLE_BACKOFF="0.5",
        CELERY_LEDGER_UNAVAILABLE_BACKOFF_MAX="1",
    )
    app = client_app(env)
    try:
        with processes(tmp_path, env) as procs:
            worker = procs.worker("w1", concurrency=1)
            result = app.send_task("tests_app.order", args=("ord-down", 5))
            worker.wait_log("ledger unavailable at claim", timeout=30, count=2)
            assert effect_counts(pg_url, "ord-down") == {}, "body ran without a ledger"
            proxy = TcpProxy("127.0.0.1", int(host_port.split(":")[1]), port=port).start()
            # Bounded, not timed: under CI load (three test processes on two cores) the
            # redelivery after the backoff once took longer than 60 s.
            value = result.get(timeout=120)
    finally:
        proxy.stop()
    assert value["steps"] == ["reserve:ord-down", "charge:ord-down", "receipt:ord-down"]
    assert effect_counts(pg_url, "ord-down") == {
        ("ord-down", "reserve"): 1,
        ("ord-down", "charge"): 1,
        ("ord-down", "receipt"): 1,
    }


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
