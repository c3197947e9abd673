"""The consumer watchdog against a real broker restart, plain Celery beside the ledgered run.

Each broker is a server of the test's own (``celery_ledger.harness.brokers``): a redis-server
without persistence, or a second RabbitMQ node. Both runs (plain Celery 5.7 with
``acks_late``, and the ledgered run with ``ledger_consumer_watchdog = "restart"`` and a 5 s
bound) take half their orders, then the broker is killed with SIGKILL and started again on the
same port, then the other half is sent to each queue. What each worker did after the cut is
printed (the issue asks for the figures); what is asserted is only what the ledger promises:
the ledgered worker consumes the orders sent after the cut, each effect once.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from celery_ledger.harness import demo_app
from celery_ledger.harness.brokers import OwnRabbitMQ, OwnRedis
from celery_ledger.harness.orchestrate import Phases, Workload, staged
from celery_ledger.harness.processes import wait_for, wait_ready
from celery_ledger.harness.verify import KINDS

LEDGERED, PLAIN = KINDS
HALF = 8
BOUND = 5.0
#: How long after the restart the ledgered run gets to take the orders sent after it.
WINDOW = 90.0
#: How long plain Celery is watched for the same, once the ledgered run has taken them: its
#: figure is printed, not asserted (a plain worker on Redis often never consumes again), so
#: the test does not wait out the whole window for it.
PLAIN_WINDOW = 20.0


def send(work: Workload, first: int, gap: float) -> None:
    """Send orders ``first..`` of ``work`` (as ``Workload.enqueue`` does, for a part)."""
    app = demo_app.build_app(work.env)
    try:
        with app.producer_or_acquire() as producer:
            for i in range(first, len(work.order_ids)):
                if i >= first + HALF:
                    break
                args = (work.run, work.order_ids[i], 10 + i, gap)
                app.send_task(work.kind.task, args=args, producer=producer)
    finally:
        app.close()


def after_cut(work: Workload) -> set[str]:
    """Orders sent after the cut that completed (their last effect, the receipt, exists)."""
    return work.refresh().with_effect("receipt") & set(work.order_ids[HALF:])


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_a_broker_restart_plain_celery_beside_the_watchdog(kind, pg_url, tmp_path, monkeypatch):
    monkeypatch.setenv("CELERY_LEDGER_PUBLISH_INTENT_SECONDS", "8")
    own: Any = OwnRedis(tmp_path) if kind == "redis" else OwnRabbitMQ()
    own.start()
    figures: dict[str, Any] = {}
    try:
        with staged(
            "watchdog", broker=own.url, ledger=pg_url, keep=False, phases=Phases(1, quiet=True)
        ) as stage:
            watch = {
                "CELERY_LEDGER_CONSUMER_WATCHDOG": "restart",
                "CELERY_LEDGER_CONSUMER_WATCHDOG_SECONDS": str(BOUND),
            }
            ledgered = stage.workload(LEDGERED, orders=2 * HALF, concurrency=2, env=watch)
            plain = stage.workload(
                PLAIN,
                orders=2 * HALF,
                concurrency=2,
                env={"CELERY_LEDGER_CONSUMER_WATCHDOG": "off"},
            )
            works = (ledgered, plain)
            wait_ready([w.start_worker("w1") for w in works] + [ledgered.start_beat()])
            for w in works:
                send(w, 0, 0.3)
            wait_for(
                lambda: all(w.refresh().rows >= 3 for w in works),
                timeout=60,
                what="both runs under way",
            )
            own.kill()
            time.sleep(2.0)  # the outage: both workers find the broker gone
            own.start()
            restarted_at = time.monotonic()
            for w in works:
                send(w, HALF, 0.1)
            took: dict[str, float | None] = {w.kind.id: None for w in works}
            deadline = restarted_at + WINDOW
            while time.monotonic() < deadline and None in took.values():
                if took[LEDGERED.id] is not None and time.monotonic() - restarted_at > max(
                    PLAIN_WINDOW, took[LEDGERED.id]
                ):
                    break  # plain Celery's figure: not within this window
                for w in works:
                    if took[w.kind.id] is None and len(after_cut(w)) == HALF:
                        took[w.kind.id] = round(time.monotonic() - restarted_at, 1)
                time.sleep(0.5)
            for w in works:
                log = w.workers["w1"].log_text()
                figures[w.kind.id] = {
                    "after_cut_completed": len(after_cut(w)),
                    "after_cut_sent": HALF,
                    "all_after_cut_done_in_s": took[w.kind.id],
                    "watched_for_s": round(time.monotonic() - restarted_at, 1),
                    "couldnt_ack_logged": log.count("Couldn't ack"),
                    "connection_lost_logged": log.count("Connection to broker lost"),
                    "watchdog_stalls_logged": log.count("consumer stalled"),
                }
            stage.orch.stop_all()
            runs = stage.tally()
    finally:
        own.stop()
    print(json.dumps({kind: figures}, sort_keys=True))
    led = runs[LEDGERED.id]
    assert led.duplicate_effects == 0 and led.ledger_duplicate_executions == 0, led
    # The ledgered worker consumed every order sent after the cut, within the window.
    assert figures[LEDGERED.id]["after_cut_completed"] == HALF, figures
