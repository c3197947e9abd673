"""A process forked while another of its threads holds a ledger transaction on SQLite can
still write the ledger (design.md § "The embedded default's pool").

SQLite keeps a process's file locks in memory, and a fork copies that memory: a child forked
during a parent thread's transaction believed a connection of its own held the write lock,
and every write it tried failed with "database is locked", for its whole life. A worker
parent writes the ledger from threads of its own while billiard forks pool processes from
another, so a pool process forked at that instant never claimed a task.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest

from celery_ledger.ledger import LedgerStore, forkgate
from celery_ledger.ledger.forkgate import GATE

#: How long the parent's thread keeps its transaction open after the fork was asked for.
HOLD_SECONDS = 0.5
#: The child's own busy timeout: the parent's transaction has long ended by then.
CHILD_BUSY_SECONDS = 3.0


def _engine_unit(store: LedgerStore) -> AbstractContextManager[Any]:
    return store.engine.begin()  # BEGIN IMMEDIATE: the write lock


def _fast_unit(store: LedgerStore) -> AbstractContextManager[Any]:
    return store.fast.cursor()  # the hot path's own BEGIN IMMEDIATE ... COMMIT


def _child_writes(path: str) -> int:
    """In the child: 0 when a fresh connection of its own can write."""
    time.sleep(HOLD_SECONDS * 2)  # the parent's transaction has ended by now, whatever happened
    try:
        conn = sqlite3.connect(path, isolation_level=None, timeout=CHILD_BUSY_SECONDS)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO fork_probe VALUES (2)")
        conn.execute("COMMIT")
        return 0
    except sqlite3.OperationalError:
        return 1


@pytest.fixture
def store(tmp_path) -> Iterator[LedgerStore]:
    store = LedgerStore(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    store.ensure_ready()
    with store.engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE fork_probe (x INTEGER)")
    yield store
    store.engine.dispose()


@pytest.mark.parametrize("unit", [_engine_unit, _fast_unit], ids=["engine", "hot-path"])
def test_a_child_forked_during_a_parent_thread_transaction_can_write(
    store: LedgerStore, unit: Callable[[LedgerStore], AbstractContextManager[Any]]
) -> None:
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with unit(store):
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(10), "the parent's thread never began its transaction"
    # The transaction ends HOLD_SECONDS after the fork is asked for, from a third thread.
    threading.Timer(HOLD_SECONDS, release.set).start()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 2
        try:
            code = _child_writes(str(store.engine.url.database))
        finally:
            os._exit(code)
    holder.join(10)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child could not write the ledger"


def _fork_and_reap() -> float:
    """Fork a child that exits at once; the seconds the fork itself took in the parent."""
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    took = time.monotonic() - started
    os.waitpid(pid, 0)
    return took


def test_a_fork_gives_up_on_an_entry_that_never_leaves(monkeypatch, caplog) -> None:
    """A connection that is never given back delays one fork by ``FORK_WAIT``, logged, and
    no later fork: the worker still replaces its pool processes."""
    monkeypatch.setattr(forkgate, "FORK_WAIT", 1.0)
    GATE.enter("never-leaves")
    try:
        assert _fork_and_reap() >= 1.0  # it waited for the entry
        _fork_and_reap()
    finally:
        GATE.leave("never-leaves")
    forced = [r for r in caplog.records if "still in use" in r.getMessage()]
    assert len(forced) == 1, [r.getMessage() for r in forced]
