"""Unit tests of ``celery_ledger.flower.states``: the ledger's events as Flower's task list reads
them, fed event by event (the same dicts Celery's ``EventReceiver`` hands Flower). The real
worker and Flower processes are in ``tests/test_flower.py``."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

pytest.importorskip("flower")

from celery_ledger.app import SWEEP_ID_PREFIX, SWEEP_TASK
from celery_ledger.flower.states import BLOCKED, INTERRUPTED, LedgerEventsState

_clock = itertools.count(1)
HOST = "w1@test"


def ev(type_: str, uuid: str, **fields: Any) -> dict[str, Any]:
    n = next(_clock)
    return {
        "type": type_,
        "uuid": uuid,
        "hostname": HOST,
        "timestamp": 1_000_000.0 + n,
        "local_received": 1_000_000.0 + n,
        "clock": n,
        **fields,
    }


def feed(state: LedgerEventsState, *events: dict[str, Any]) -> None:
    for e in events:
        state.event(e)


@pytest.fixture
def state() -> LedgerEventsState:
    return LedgerEventsState(max_tasks_in_memory=100)


def run_start(uuid: str, name: str = "shop.pay") -> list[dict[str, Any]]:
    return [ev("task-received", uuid, name=name, args="()", kwargs="{}"), ev("task-started", uuid)]


def test_blocked_is_not_a_failure(state: LedgerEventsState) -> None:
    feed(
        state,
        *run_start("t1"),
        ev("task-ledger-resumed", "t1", key="k", fence=2),
        ev("task-ledger-blocked", "t1", key="k", fence=2),
        ev("task-failed", "t1", exception="LedgerBlocked('charge is ambiguous')", traceback="tb"),
        *run_start("t2"),
        ev("task-ledger-conflict", "t2", key="k2", fence=0),
        ev("task-failed", "t2", exception="KeyConflict('other arguments')"),
    )
    assert state.tasks["t1"].state == BLOCKED
    assert state.tasks["t2"].state == "FAILURE", "a KeyConflict is a failure"
    assert state.counter[HOST]["task-failed"] == 1, "only the conflict counts as failed"
    assert state.search_engine.documents["t1"] is not None


def test_a_lost_pool_process_shows_interrupted_until_the_redelivery_runs(
    state: LedgerEventsState,
) -> None:
    feed(state, *run_start("t1"), ev("task-ledger-claimed", "t1", key="k", fence=1))
    assert state.tasks["t1"].state == "LEDGER-CLAIMED"
    feed(state, ev("task-rejected", "t1", requeue=True))
    assert state.tasks["t1"].state == INTERRUPTED
    feed(state, *run_start("t1"))
    assert state.tasks["t1"].state == INTERRUPTED, "received/started rank below it"
    feed(state, ev("task-ledger-resumed", "t1", key="k", fence=2))
    assert state.tasks["t1"].state == "LEDGER-RESUMED"
    # WorkerLostError as a failure (no reject_on_worker_lost) reads the same way
    feed(
        state,
        *run_start("t3"),
        ev("task-ledger-claimed", "t3", key="k3", fence=1),
        ev("task-failed", "t3", exception="WorkerLostError('Worker exited prematurely')"),
    )
    assert state.tasks["t3"].state == INTERRUPTED
    # ...but not for a task the ledger never saw
    feed(
        state,
        *run_start("plain", name="plain.add"),
        ev("task-failed", "plain", exception="WorkerLostError('Worker exited prematurely')"),
    )
    assert state.tasks["plain"].state == "FAILURE"


def test_a_released_task_that_succeeds_drops_the_old_failure(state: LedgerEventsState) -> None:
    feed(
        state,
        *run_start("t1"),
        ev("task-ledger-blocked", "t1", key="k", fence=1),
        ev("task-failed", "t1", exception="LedgerBlocked('x')", traceback="Traceback ..."),
        *run_start("t1"),
        ev("task-ledger-claimed", "t1", key="k", fence=2),
        ev("task-ledger-settled", "t1", key="k", fence=2, status="completed"),
        ev("task-succeeded", "t1", result="'ok'", runtime=0.1),
    )
    task = state.tasks["t1"]
    assert task.state == "SUCCESS"
    assert (task.exception, task.traceback, task.failed) == (None, None, None)
    assert task.result == "'ok'"


def test_resumes_replays_and_zombies_stay_visible_after_success(state: LedgerEventsState) -> None:
    feed(
        state,
        *run_start("t1"),
        ev("task-ledger-claimed", "t1", key="k", fence=1),  # the attempt that gets SIGSTOPped
        *run_start("t1"),
        ev("task-ledger-resumed", "t1", key="k", fence=2),
        ev("task-ledger-replayed", "t1", key="k", fence=2, steps=1),
    )
    assert state.tasks["t1"].state == "LEDGER-RESUMED", "transient events keep the state"
    feed(
        state,
        ev("task-ledger-settled", "t1", key="k", fence=2, status="completed"),
        ev("task-succeeded", "t1", result="1"),
        ev("task-ledger-fenced", "t1", key="k", fence=1, reason="superseded"),
    )
    task = state.tasks["t1"]
    assert task.state == "SUCCESS"
    assert task.ledger == ["claimed", "resumed", "replayed", "settled", "fenced"]
    assert task.as_dict()["ledger"] == task.ledger, "Flower's API and task page show it"


def test_sweeps_never_become_tasks(state: LedgerEventsState) -> None:
    sweep = f"{SWEEP_ID_PREFIX}abc"
    feed(
        state,
        ev("task-received", "s1", name=SWEEP_TASK, args="()", kwargs="{}"),
        ev("task-started", "s1"),
        ev("task-succeeded", "s1", result="{}"),
        # expired in a backlog: revoked before any event named it
        ev("task-revoked", sweep, expired=True, terminated=False, signum=None),
    )
    assert "s1" not in state.tasks and sweep not in state.tasks
    assert state.last_sweep is not None and state.last_sweep["uuid"] == sweep
    assert state.counter[HOST]["task-revoked"] == 1
    events = state.metrics.events
    assert events.labels(HOST, "task-revoked", SWEEP_TASK)._value.get() >= 1
    assert ("", "task-revoked", "") not in {
        (w, t, n) for (w, t, n) in events._metrics if w == HOST and n == ""
    }


def test_a_worker_going_offline_interrupts_its_running_ledger_tasks(
    state: LedgerEventsState,
) -> None:
    feed(state, *run_start("t1"), ev("task-ledger-claimed", "t1", key="k", fence=1))
    state.event(
        {
            "type": "worker-offline",
            "hostname": HOST,
            "timestamp": 1_000_100.0,
            "local_received": 1_000_100.0,
        }
    )
    assert state.tasks["t1"].state == INTERRUPTED


def test_the_sweep_task_ids_carry_the_prefix() -> None:
    from celery import Celery

    from celery_ledger.app import install

    app = Celery("prefix-check", broker="memory://")
    install(app)
    app.conf.task_always_eager = False
    sent = app.tasks[SWEEP_TASK].apply_async(connection=app.connection_for_write())
    assert sent.id.startswith(SWEEP_ID_PREFIX)
    given = app.tasks[SWEEP_TASK].apply_async(task_id="mine", connection=app.connection_for_write())
    assert given.id == "mine"


def test_a_worker_whose_heartbeats_stopped_interrupts_its_running_ledger_tasks(
    state: LedgerEventsState,
) -> None:
    import time

    now = time.time()
    beat = {"type": "worker-heartbeat", "hostname": HOST, "freq": 2.0, "active": 1}
    state.event({**beat, "timestamp": now, "local_received": now})
    feed(state, *run_start("t1"), ev("task-ledger-claimed", "t1", key="k", fence=1))
    assert state.check_workers() == 0, "alive: nothing to mark"
    assert state.tasks["t1"].state == "LEDGER-CLAIMED"
    # Its last heartbeat is now long past (a worker SIGKILLed whole sends nothing more).
    state.workers[HOST].heartbeats[:] = [now - 60]
    assert state.check_workers() == 1
    assert state.tasks["t1"].state == INTERRUPTED
    assert state.tasks["t1"].ledger[-1] == "interrupted"
    assert not state.running_ledger


def test_an_operators_release_shows_until_a_new_attempt_runs(state: LedgerEventsState) -> None:
    from celery_ledger.flower.states import RELEASED

    feed(
        state,
        *run_start("t1"),
        ev("task-ledger-blocked", "t1", key="k", fence=1),
        ev("task-failed", "t1", exception="LedgerBlocked('x')"),
        {**ev("task-ledger-marked-dead", "t1", key="k", fence=1, by="ann"), "hostname": "cli@x"},
    )
    assert state.tasks["t1"].state == BLOCKED, "mark-dead changes no state"
    feed(state, {**ev("task-ledger-released", "t1", key="k", fence=2, verified="completed")})
    assert state.tasks["t1"].state == RELEASED
    assert state.tasks["t1"].ledger[-3:] == ["blocked", "marked-dead", "released"]
