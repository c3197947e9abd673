"""The consumer watchdog's rule, on a stand-in consumer and a stepped clock (no broker): what
is a stall, what is not, and what a restart does. Its behaviour on a real broker restart is
``tests/test_consumer_watchdog.py``."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import amqp
import pytest
from celery.worker import state as worker_state
from kombu.transport import redis as kombu_redis

from celery_ledger.settings import LedgerSettings
from celery_ledger.watchdog import ConsumerStalled, ConsumerWatchdog, doctor_check
from celery_ledger.watchdog_metrics import ask_workers, families


class Hub:
    def __init__(self) -> None:
        self.soon: list[Any] = []

    def call_soon(self, callback: Any) -> None:
        self.soon.append(callback)


class Held:
    """A request the worker holds (weak-referenceable, as Celery's requests are)."""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def consumer(prefetch: int = 2) -> Any:
    return SimpleNamespace(
        app=None,
        restart_count=1,
        qos=SimpleNamespace(value=prefetch),
        task_consumer=SimpleNamespace(queues=[SimpleNamespace(name="orders")]),
        hub=Hub(),
    )


def watchdog(c: Any, clock: Clock, depth: list[int | None], mode: str = "log") -> ConsumerWatchdog:
    return ConsumerWatchdog(
        c, mode=mode, bound_seconds=10.0, depth_of=lambda q: depth[0], clock=clock
    )


def test_messages_waiting_and_none_received_past_the_bound_is_a_stall(caplog) -> None:
    c, clock, depth = consumer(), Clock(), [3]
    w = watchdog(c, clock, depth)
    clock.now += 9.0
    assert not w.check().stalled  # within the bound
    clock.now += 2.0
    with caplog.at_level(logging.WARNING, logger="celery_ledger.watchdog"):
        state = w.check()
        assert state.stalled and state.stalls == 1 and state.waiting == 3
        w.check()  # the same stall: counted and logged once
    assert w.state.stalls == 1
    assert [r.message for r in caplog.records if "stalled" in r.message] == [
        "consumer stalled: 3 message(s) wait in orders and none reached this worker for 11s "
        "(bound 10s)"
    ]
    assert c.hub.soon == []  # mode "log" restarts nothing
    w.received()
    with caplog.at_level(logging.WARNING, logger="celery_ledger.watchdog"):
        assert not w.check().stalled
    assert any("stall over" in r.message for r in caplog.records)


@pytest.mark.parametrize("waiting", [0, None])
def test_an_idle_worker_beside_an_empty_or_unknown_queue_is_not_stalled(waiting) -> None:
    c, clock = consumer(), Clock()
    w = watchdog(c, clock, [waiting])
    clock.now += 3600.0
    assert not w.check().stalled


def test_a_worker_whose_prefetch_is_full_is_busy_not_stalled() -> None:
    c, clock = consumer(prefetch=2), Clock()
    w = watchdog(c, clock, [50])
    clock.now += 3600.0
    held = [Held(), Held()]
    for r in held:
        worker_state.reserved_requests.add(r)
    try:
        assert not w.check().stalled
        worker_state.reserved_requests.discard(held[0])
        assert w.check().stalled  # room for one more, and none arrives
    finally:
        for r in held:
            worker_state.reserved_requests.discard(r)


def test_a_reconnected_consumer_gets_its_bound_again() -> None:
    c, clock = consumer(), Clock()
    w = watchdog(c, clock, [5])
    clock.now += 30.0
    c.restart_count += 1  # Celery's consumer reconnected
    assert not w.check().stalled
    clock.now += 11.0
    assert w.check().stalled


def test_restart_raises_a_connection_error_on_the_consumers_loop() -> None:
    c, clock = consumer(), Clock()
    w = watchdog(c, clock, [5], mode="restart")
    clock.now += 11.0
    assert w.check().stalled and w.state.restarts == 1
    [callback] = c.hub.soon
    with pytest.raises(ConsumerStalled) as caught:
        callback()
    # What Celery's consumer catches as a lost connection, on either broker.
    assert isinstance(caught.value, kombu_redis.Transport.connection_errors)
    assert isinstance(caught.value, amqp.Connection.connection_errors)
    w.check()  # still stalled: no second restart within one stall
    assert len(c.hub.soon) == 1


def test_the_settings() -> None:
    s = LedgerSettings.from_mapping({}, env={})
    assert (s.consumer_watchdog, s.consumer_watchdog_seconds) == ("log", 120.0)
    env = {
        "CELERY_LEDGER_CONSUMER_WATCHDOG": " Restart ",
        "CELERY_LEDGER_CONSUMER_WATCHDOG_SECONDS": "5",
    }
    s = LedgerSettings.from_mapping({}, env=env)
    assert (s.consumer_watchdog, s.consumer_watchdog_seconds) == ("restart", 5.0)
    with pytest.raises(
        ValueError, match="^ledger_consumer_watchdog must be one of off, log, restart$"
    ):
        LedgerSettings.from_mapping({"ledger_consumer_watchdog": "sometimes"}, env={})
    with pytest.raises(ValueError, match="^ledger_consumer_watchdog_seconds must be > 0$"):
        LedgerSettings.from_mapping({"ledger_consumer_watchdog_seconds": 0}, env={})


def test_doctor_warns_when_the_watchdog_is_off() -> None:
    name, status, why = doctor_check(
        LedgerSettings.from_mapping({"ledger_consumer_watchdog": "off"}, env={})
    )
    assert (name, status) == ("consumer", "WARN") and "ledger_consumer_watchdog=off" in why
    assert doctor_check(LedgerSettings.from_mapping({}, env={}))[1] == "PASS"


def test_the_gauges_per_worker() -> None:
    replies = {"w1@h": {"stalled": True, "idle_seconds": 12.5, "stalls": 2, "restarts": 1}}
    got = {m.name: [(s.labels, s.value) for s in m.samples] for m in families(replies)}
    assert got == {
        "celery_ledger_consumer_stalled": [({"worker": "w1@h"}, 1.0)],
        "celery_ledger_consumer_idle_seconds": [({"worker": "w1@h"}, 12.5)],
        "celery_ledger_consumer_stalls": [({"worker": "w1@h"}, 2.0)],
        "celery_ledger_consumer_restarts": [({"worker": "w1@h"}, 1.0)],
    }


def test_the_inspect_command_and_its_replies() -> None:
    from celery.worker.control import Panel

    from celery_ledger.watchdog import install

    install()  # what celery_ledger.install(app) runs once per process
    assert Panel.data["ledger_consumer"](None) == {"watchdog": None}  # no watchdog here
    replies = [{"w1@h": {"watchdog": {"stalls": 1}}}, {"w2@h": {"watchdog": None}}]
    control = SimpleNamespace(broadcast=lambda name, reply, timeout: replies)
    app = SimpleNamespace(control=control)
    assert ask_workers(app, timeout=1.0) == {
        "w1@h": {"watchdog": {"stalls": 1}},
        "w2@h": {"watchdog": None},
    }
