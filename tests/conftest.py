from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

from servers import (
    create_rabbitmq_vhost,
    delete_rabbitmq_vhost,
    drop_pg_pool,
    give_back_pg_database,
    redis_url,
    take_pg_database,
)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.sqlite3'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL database of this test's own, emptied afterwards for the next test."""
    name, url = take_pg_database()
    try:
        yield url
    finally:
        give_back_pg_database(name)


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The contract-suite backend: each test runs on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        return
    name, url = take_pg_database()
    try:
        yield url
    finally:
        give_back_pg_database(name)


@pytest.fixture
def store(ledger_url: str) -> Iterator[object]:
    from celery_ledger.ledger import LedgerStore

    s = LedgerStore(ledger_url)
    try:
        yield s
    finally:
        s.dispose()


@pytest.fixture
def redis() -> str:
    return redis_url()


@pytest.fixture
def rabbitmq() -> Iterator[str]:
    """An ``amqp://`` URL on a vhost of this test's own, deleted (with its queues) afterwards."""
    name, url = create_rabbitmq_vhost()
    try:
        yield url
    finally:
        delete_rabbitmq_vhost(name)


#: Modules whose tests each run a whole chaos workload (several workers, beat, kills): they run
#: one at a time in one xdist worker, so that two of them never share the two cores at once.
HEAVY = {"test_verify", "test_demo", "test_benchmarks", "test_broker_faults"}


#: The longest tests outside those groups (``--durations``), by module and name (any
#: parameters): they start first, so that the run does not end waiting for one of them
#: started last. Only their order changes.
LONG_FIRST = (
    "test_pgbouncer.py::test_verify_through_pgbouncer",
    "test_protocol_model.py::test_protocol_model",
    "test_fuzz_messages.py::test_two_hundred_malformed_messages",
    "test_canvas.py::test_chord_members_killed",
    "test_outbox_hostile.py::test_a_child_the_broker_refuses_never_holds_back_the_others",
    "test_ledger_crash.py::test_three_ledger_crashes",
    "test_rate_limits.py::test_the_limit_holds_across_four_workers",
    "test_consumer_watchdog.py::test_a_broker_restart_plain_celery_beside_the_watchdog",
    "test_cli.py::test_full_story_blocked_found_shown_released_runs_once",
    "test_delivery.py::test_same_task_id_redelivered_by_redis_runs_body_once",
    "test_canvas.py::test_link_error_under_redelivery_is_published_once",
    "test_seams.py::test_a_reconcilers_not_executed_waits_out_a_paused_attempt",
    "test_time.py::test_cancel_stops_a_running_task_at_its_next_step",
    "test_seams.py::test_a_backlog_does_not_multiply_itself",
    "test_sealing.py::test_a_sealed_snapshot_is_resumed_by_a_process_with_the_key",
    "test_death_signal.py::test_a_sigstopped_zombie_blocks_mark_dead",
    "test_harness_intents.py::",
    "test_recovery.py::test_paused_worker_is_fenced_out_after_takeover",
    "test_flower.py::test_flower_task_list_tells_what_the_ledger_did",
)


def _rank(item: pytest.Item) -> int:
    """The item's place in ``LONG_FIRST`` (the longest first); after them, every other."""
    path = item.nodeid.rpartition("/")[2]
    return next((i for i, p in enumerate(LONG_FIRST) if path.startswith(p)), len(LONG_FIRST))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for ``--dist loadgroup``: every test on RabbitMQ runs in one xdist worker, one at a
    time (some restart the shared server's app or shorten its ``consumer_timeout`` for a moment,
    which would cut the connections of any other RabbitMQ test beside them); the chaos
    workloads share another. xdist hands out the groups first (the most tests first), then
    single tests in this order: the long ones (``LONG_FIRST``) are moved to the front.

    First of every plugin's hook: xdist's own reads the markers to append ``@group`` to each
    node id, and a marker added after it is ignored (``test_rabbitmq_group.py``)."""
    items.sort(key=_rank)  # stable: the rest keep their order
    for item in items:
        # A test on the shared RabbitMQ by fixture, or by a parameter (test_broker_faults.py's
        # `broker`: the tests that stop the server's app and shorten its consumer_timeout).
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "rabbitmq" in getattr(item, "fixturenames", ()) or params.get("broker") == "rabbitmq":
            item.add_marker(pytest.mark.xdist_group("rabbitmq-server"))
        elif item.module is not None and item.module.__name__ in HEAVY:
            item.add_marker(pytest.mark.xdist_group("chaos-workloads"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The databases this process kept for reuse are dropped with it (also in each xdist
    worker, which may end without running ``atexit``)."""
    drop_pg_pool()
