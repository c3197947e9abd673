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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for ``--dist loadgroup``: every test on RabbitMQ runs in one xdist worker, one at a
    time (some restart the shared server's app or shorten its ``consumer_timeout`` for a moment,
    which would cut the connections of any other RabbitMQ test beside them); the chaos
    workloads share another."""
    for item in items:
        if "rabbitmq" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("rabbitmq-server"))
        elif item.module is not None and item.module.__name__ in HEAVY:
            item.add_marker(pytest.mark.xdist_group("chaos-workloads"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The databases this process kept for reuse are dropped with it (also in each xdist
    worker, which may end without running ``atexit``)."""
    drop_pg_pool()
