"""guarantees.md § "Bad input": a naive datetime (``eta``, ``wait_until``) means UTC, as in Celery.

Each case runs in a process whose local time is not UTC (``TZ=America/Los_Angeles``): a naive
datetime read as local time would land eight hours (or seven) late.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from test_time import producer, time_env
from time_app import TIME_TASKS

from celery_ledger.ledger import EntryNotFound, EntryStatus, LedgerStore
from helpers import key_of
from procs import processes, wait_for

pytestmark = pytest.mark.processes

ZONE = "America/Los_Angeles"


@pytest.fixture
def local_time_not_utc(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TZ", ZONE)
    time.tzset()
    assert time.timezone != 0
    yield
    monkeypatch.undo()
    time.tzset()


def utc_wall(seconds: float) -> datetime:
    """UTC ``seconds`` from now, as a naive datetime."""
    return datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(seconds=seconds)


def due_in(store: LedgerStore, key: str) -> float | None:
    try:
        entry = store.get_entry(key)
    except EntryNotFound:
        return None
    if entry.status not in (EntryStatus.SCHEDULED, EntryStatus.SLEEPING) or entry.due_at is None:
        return None
    return float(entry.due_at - store.now())


def test_a_naive_eta_the_ledger_holds_is_utc(
    tmp_path: Path, redis: str, pg_url: str, local_time_not_utc: Any
) -> None:
    env = time_env(tmp_path, redis, pg_url)
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    try:
        result = tasks["once"].apply_async(args=("naive-eta",), eta=utc_wall(3600))
        left = due_in(store, key_of("time_app.once", result.id))
        assert left is not None and abs(left - 3600) < 120, left
    finally:
        store.dispose()


def test_wait_until_a_naive_datetime_is_utc(tmp_path: Path, redis: str, pg_url: str) -> None:
    env = time_env(tmp_path, redis, pg_url)
    app, tasks = producer(tmp_path, env)
    store = LedgerStore(pg_url)
    try:
        with processes(tmp_path, env) as procs:
            procs.worker("w1", concurrency=1, extra=TIME_TASKS, env={"TZ": ZONE})
            result = app.send_task("time_app.sleep_naive", args=("naive-wait", 1800.0))
            key = key_of("time_app.sleep_naive", result.id)
            wait_for(lambda: due_in(store, key) is not None, timeout=60, what="it to sleep")
            left = due_in(store, key)
            assert left is not None and abs(left - 1800) < 120, left
    finally:
        store.dispose()
    assert os.environ.get("TZ") != ZONE
